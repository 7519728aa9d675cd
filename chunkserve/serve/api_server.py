"""The FastAPI app: vLLM's OpenAI-compatible endpoints, error shapes, auth and limits."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkserve import __version__
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.serve.async_engine import AsyncEngine
from chunkserve.serve.metrics import ServerMetrics
from chunkserve.serve.openai_endpoints import register_openai_routes
from chunkserve.serve.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_error_message,
)
from chunkserve.serve.serving import ApiError, Serving

log = logging.getLogger("chunkserve.server")
T = TypeVar("T")
DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any prompt this server can hold


class BodySizeLimit:
    """Counts body bytes as the app reads them: a chunked upload declares no length up front.

    Past the limit the body read fails (FastAPI then answers 400 "error parsing the body");
    this middleware swallows that response and sends 413 with an OpenAI error body instead.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = 0
        exceeded = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise ValueError("request body too large")
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not exceeded:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)
        if exceeded:
            await error_response(_too_large(self.max_bytes))(scope, receive, send)


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(e.message, e.err_type, e.status, e.param), e.status, headers=e.headers
    )


def build_app(
    engine: LLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    metrics = ServerMetrics(served_model_name, engine.max_model_len)
    async_engine = AsyncEngine(engine, metrics)
    serving = Serving(async_engine, served_model_name, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        # Shutdown: uvicorn has stopped accepting and drained (or cancelled) the handlers.
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="chunkserve", version=__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.state.serving = serving
    app.state.metrics = metrics

    @app.middleware("http")
    async def limits_and_auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]):  # type: ignore[no-untyped-def]
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return error_response(_too_large(max_body_bytes))
        # vLLM checks the key on /v1 only: health and metrics stay open to probes.
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse({"error": "Unauthorized"}, 401)
        return await call_next(request)

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

    @app.exception_handler(Exception)
    async def on_internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(str(e), "InternalServerError", 500), 500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_healthy else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        if req.messages is not None:
            text = await asyncio.to_thread(
                serving.tokenizer.apply_chat_template, req.messages, req.add_generation_prompt
            )
            tokens = await serving.tokenize(text, add_special_tokens=False)
        else:
            tokens = await serving.tokenize(req.prompt or "", req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(req.model)
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"Token ids must be integers in [0, {vocab}).", param="tokens")
        text = await asyncio.to_thread(serving.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": served_model_name, "object": "model", "created": 0,
                "owned_by": "chunkserve", "root": engine.config.model_config.model,
                "max_model_len": serving.max_model_len,
            }],
        }

    register_openai_routes(app, serving)
    return app


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body is larger than {limit} bytes.", "RequestTooLargeError")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work` unless the client hangs up first; then cancels it (aborting its requests).

    After the body has been read, the only message left on the connection is the disconnect.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()

