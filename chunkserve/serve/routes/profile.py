"""vLLM's profiler endpoints, served with `--profiler-dir` (or `VLLM_TORCH_PROFILER_DIR`).

As in vLLM each answers 200 with an empty body once every engine has done it; a stop writes
each engine's torch.profiler trace into the directory before answering (engine/profiler.py).
A start while a profile runs, or a stop without one, is a 400.
"""
from __future__ import annotations

from collections.abc import Awaitable

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from chunkserve.engine.profiler import ProfilerStateError
from chunkserve.serve.openai.serving import ApiError, Serving, get_serving

router = APIRouter()


@router.post("/start_profile")
async def start_profile(serving: Serving = Depends(get_serving)) -> Response:
    return await _answered(serving.async_engine.start_profile())


@router.post("/stop_profile")
async def stop_profile(serving: Serving = Depends(get_serving)) -> Response:
    return await _answered(serving.async_engine.stop_profile())


async def _answered(call: Awaitable[None]) -> Response:
    try:
        await call
    except ProfilerStateError as e:
        raise ApiError(400, str(e)) from None
    return Response(status_code=200)
