"""Cache-control endpoints, as vLLM's server has them."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from chunkserve.serve.async_engine import AsyncEngine


def register_cache_routes(app: FastAPI, async_engine: AsyncEngine) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # Always succeeds: running requests keep their blocks, only the index is forgotten
        # (vLLM refuses while requests run; nothing here needs that restriction).
        await async_engine.reset_prefix_cache()
        return Response(status_code=200)
