"""The built-in web page (GET /, its files under /web/) and the live step stream it reads
(GET /engine/steps), served unless `--no-web-ui`.

Auth, as llama.cpp's llama-server does it: a browser cannot send a Bearer header on a plain page
load, so the page's own files (HTML, CSS, JS: no data, nothing that runs the model) are served
without the key (`PAGE_PATHS`, added to the middleware's open paths), and the page asks for the
key and sends it as `Authorization: Bearer` on everything it fetches: the chat API and the step
stream, which stay behind --api-key like every other endpoint.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from chunkserve.serve.openai.endpoints import sse
from chunkserve.serve.step_stream import INTERVAL_S, RECORD_EVENTS, StepStream

router = APIRouter()
# The page's files, by the type they are served as; nothing else under web/ is reachable.
WEB_FILES = {"index.html": "text/html; charset=utf-8",
             "style.css": "text/css; charset=utf-8",
             "sse.js": "text/javascript; charset=utf-8",
             "chat.js": "text/javascript; charset=utf-8",
             "engine.js": "text/javascript; charset=utf-8"}
PAGE_PATHS = frozenset({"/", *(f"/web/{name}" for name in WEB_FILES)})
# Every response of the page says where it may fetch from: only this server.
_HEADERS = {"Cache-Control": "no-cache",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:"}


def _file(name: str) -> Response:
    body = resources.files("chunkserve.serve").joinpath("web", name).read_bytes()
    return Response(body, media_type=WEB_FILES[name], headers=_HEADERS)


# The page's routes stay out of /openapi.json: they are not part of the API, and a client
# generated from the schema (or a fuzzer) would wait forever on the endless step stream.
@router.get("/", include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@router.get("/web/{name}", include_in_schema=False)
async def web_file(name: str) -> Response:
    if name not in WEB_FILES:
        raise HTTPException(404, "Not Found")
    return _file(name)


class _StepsResponse(StreamingResponse):
    """Closes its events however the response ends: a page that goes away stops being a
    subscriber at once, not whenever its generator happens to be collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


@router.get("/engine/steps", include_in_schema=False)
async def engine_steps(raw: Request) -> StreamingResponse:
    stream: StepStream = raw.app.state.step_stream
    return _StepsResponse(_events(stream), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(stream: StepStream) -> AsyncIterator[str]:
    # First what the summaries will hold, at once: the page sees the stream open before the
    # engine has stepped. `events` are the steps' request events, for readers other than the
    # page, which draws the lanes from the summaries' spans (serve/step_stream.py).
    yield sse({"hello": {"events": list(RECORD_EVENTS), "interval_s": INTERVAL_S}})
    async with contextlib.aclosing(stream.summaries()) as summaries:
        async for summary in summaries:
            yield sse(summary)
