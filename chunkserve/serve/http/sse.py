"""Response plumbing for generation requests: an SSE stream that always cleans up after itself,
and racing a non-streamed request against the client hanging up."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from chunkserve.frontend.async_engine import Ticket

T = TypeVar("T")


class SSEResponse(StreamingResponse):
    """A stream that, however it ends (finished, client gone, server cancelled), closes its
    events generator, which aborts what still runs, and gives back unused queue places.

    Without this a client that leaves before the first event leaves the generator unstarted,
    and nothing would ever release its admission ticket.
    """

    def __init__(self, events: AsyncIterator[str], ticket: Ticket) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._ticket = ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ticket.release()
            await self._events.aclose()  # type: ignore[attr-defined]


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
