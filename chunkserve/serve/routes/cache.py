"""Cache-control endpoints, as vLLM's server has them."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from chunkserve.serve.openai.serving import Serving, get_serving

router = APIRouter()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(serving: Serving = Depends(get_serving)) -> Response:
    # Always succeeds: running requests keep their blocks, only the index is forgotten
    # (vLLM refuses while requests run; nothing here needs that restriction).
    await serving.async_engine.reset_prefix_cache()
    return Response(status_code=200)
