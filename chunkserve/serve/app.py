"""The FastAPI app: vLLM's OpenAI-compatible endpoints, error shapes, auth and limits."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkserve import __version__
from chunkserve.engine.compute_thread import ComputeThread
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.frontend.async_engine import AsyncEngine
from chunkserve.serve.routes.cache import router as cache_router
from chunkserve.frontend.engine_client import EngineClient, InProcessClient
from chunkserve.serve.openai.chat_protocol import TokenizeRequest
from chunkserve.serve.http.errors import error_body, validation_error_message
from chunkserve.serve.metrics import ServerMetrics
from chunkserve.serve.http.middleware import EdgeMiddleware
from chunkserve.serve.openai.endpoints import router as openai_router
from chunkserve.serve.routes.profile import router as profile_router
from chunkserve.serve.openai.protocol import DetokenizeRequest
from chunkserve.serve.openai.serving import ApiError, Serving, get_serving
from chunkserve.serve.step_stream import StepStream
from chunkserve.serve.routes.web import PAGE_PATHS
from chunkserve.serve.routes.web import router as web_router

log = logging.getLogger("chunkserve.server")
DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any prompt this server can hold
# What probes and scrapers reach without the API key (vLLM keeps these open too).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(e.message, e.err_type, e.status, e.param), e.status, headers=e.headers
    )


router = APIRouter()


def build_app(
    engine: LLMEngine | Sequence[EngineClient],
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    compute: ComputeThread | None = None,
    metrics_require_key: bool = False,
    enable_dev_endpoints: bool = False,
    tool_call_parser: str | None = None,
    profiler_dir: str | None = None,
    web_ui: bool = True,
) -> FastAPI:
    """`engine`: one engine, or the clients of `--data-parallel-size` engine processes.
    `compute`: the thread that built `engine`, where its loop will run (engine_client.py).
    `enable_dev_endpoints` serves POST /reset_prefix_cache, which vLLM exposes only in its
    development mode: without it anyone who reaches the port could flush the cache.
    `tool_call_parser`: reads tool_choice "auto"'s calls (--enable-auto-tool-choice with
    --tool-call-parser); None refuses "auto".
    `profiler_dir` serves POST /start_profile and /stop_profile, which write each engine's
    torch.profiler trace there (the clients given were built with the same directory).
    `web_ui` serves the chat page at / and its step stream (serve/routes/web.py); off
    (`--no-web-ui`), both are 404s and no step is ever handed to a stream."""
    clients = (engine if isinstance(engine, Sequence)
               else [InProcessClient(engine, compute, profiler_dir=profiler_dir)])
    info = clients[0].info  # every engine of a data-parallel server has the same config
    metrics = ServerMetrics(served_model_name, info.max_model_len, info.num_kv_blocks,
                            info.block_size, info.kv_cache_dtype)
    # The web page's live engine view: records go to it where the metrics get them; none
    # when the web UI is off.
    step_stream = StepStream() if web_ui else None
    async_engine = AsyncEngine(clients, [metrics] + ([step_stream] if step_stream else []))
    for i in range(len(clients)):
        metrics.track_waiting(i, lambda i=i: async_engine.gauge_queued(i))
    serving = Serving(async_engine, served_model_name, max_waiting_requests, tool_call_parser,
                      metrics.count_rejected)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        # Shutdown: uvicorn has stopped accepting and drained (or cancelled) the handlers.
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="chunkserve", version=__version__, lifespan=lifespan)
    open_paths = OPEN_PATHS - ({"/metrics"} if metrics_require_key else set())
    if web_ui:
        open_paths |= PAGE_PATHS  # the page's static files only (routes/web.py says why)
    app.add_middleware(EdgeMiddleware, max_body_bytes=max_body_bytes, api_key=api_key,
                       open_paths=open_paths)
    # The routers reach these through the request (serving.get_serving), never an import.
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.model = info.model
    app.state.async_engine = async_engine
    app.state.step_stream = step_stream
    _add_error_handlers(app)
    _add_routers(app, web_ui, enable_dev_endpoints, profiler_dir)
    return app


def _add_routers(app: FastAPI, web_ui: bool, enable_dev_endpoints: bool,
                 profiler_dir: str | None) -> None:
    """The API's routes, and the optional ones the flags turn on."""
    app.include_router(router)
    app.include_router(openai_router)
    if web_ui:
        app.include_router(web_router)
    if enable_dev_endpoints:
        app.include_router(cache_router)
    if profiler_dir is not None:
        # vLLM's warning too: profiling slows every step, and anyone who can reach the port
        # can start it.
        log.warning("torch profiler endpoints enabled, traces in %s: for development only",
                    profiler_dir)
        app.include_router(profile_router)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's `{"error": {...}}` shape (FastAPI's own: 422, 404, 405)."""

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(e)
        return JSONResponse(error_body(message, "BadRequestError", 400, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err_type = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "Error")
        return JSONResponse(error_body(str(e.detail), err_type, e.status_code), e.status_code)


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(serving: Serving = Depends(get_serving)) -> Response:
    return Response(status_code=200 if serving.async_engine.is_healthy else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def prometheus(raw: Request) -> Response:
    body, content_type = raw.app.state.metrics.render()
    return Response(body, media_type=content_type)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, serving: Serving = Depends(get_serving)) -> dict[str, Any]:
    serving.check_model(req.model)
    if req.messages is not None:
        text = await serving.render_chat(req.message_dicts(), req.add_generation_prompt,
                                         req.continue_final_message, req.template_kwargs())
        tokens = await serving.tokenize(text, add_special_tokens=False)
    else:
        tokens = await serving.tokenize(req.prompt or "", req.add_special_tokens)
    return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(
    req: DetokenizeRequest, serving: Serving = Depends(get_serving)
) -> dict[str, str]:
    serving.check_model(req.model)
    vocab = serving.processor.vocab_size
    if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
        raise ApiError(400, f"Token ids must be integers in [0, {vocab}).", param="tokens")
    text = await asyncio.to_thread(serving.tokenizer.decode, req.tokens, False)
    return {"prompt": text}


@router.get("/v1/models")
async def models(raw: Request, serving: Serving = Depends(get_serving)) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{
            "id": serving.model_name, "object": "model", "created": 0,
            "owned_by": "chunkserve", "root": raw.app.state.model,
            "max_model_len": serving.max_model_len,
        }],
    }


def begin_shutdown(app: FastAPI, abort_after_s: float) -> None:
    """SIGTERM: in-flight requests get `abort_after_s` to finish; then each is aborted with a
    503 (an error event and [DONE] on a stream), so every response ends well-formed before the
    HTTP server's deadline. Call on the event loop."""
    reason = "the server is shutting down"
    loop = asyncio.get_running_loop()
    loop.call_later(abort_after_s, app.state.serving.async_engine.fail_all, reason)
