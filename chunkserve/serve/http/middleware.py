"""The ASGI layer in front of the app: body size limit, API key, and a last-resort error guard.

A plain ASGI class rather than `@app.middleware("http")`: that one (Starlette's
BaseHTTPMiddleware) runs the endpoint in a task of its own and streams its body through a
memory channel, which mixes cancellation into every streamed response.
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from chunkserve.serve.http.heap import LARGE_BODY_BYTES, HeapGuard
from chunkserve.serve.http.errors import error_body

log = logging.getLogger("chunkserve.server")


class EdgeMiddleware:
    """Runs around the whole app, inside Starlette's ServerErrorMiddleware.

    No exception gets past it. Starlette's own handler for unexpected errors answers 500 and
    then re-raises, and uvicorn answers a re-raised exception by closing the connection: the
    client's *next* request on that keep-alive connection then failed with a reset. Here the
    error is logged and answered, and the connection stays usable.
    """

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None = None,
                 open_paths: frozenset[str] | set[str] = frozenset()) -> None:
        """`open_paths`: the paths served without the API key (health probes, scrapers)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)
        self.heap = HeapGuard()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_headers = scope.get("headers") or []
        headers = dict(raw_headers)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_json(send, self._too_large())
            return
        refusal = self._check_key(raw_headers, scope.get("path", ""))
        if refusal is not None:
            await _send_json(send, *refusal)
            return
        await self._guarded(scope, receive, send, int(declared) if declared.isdigit() else 0)

    def _check_key(self, raw_headers: list[tuple[bytes, bytes]], path: str
                   ) -> tuple[tuple[int, dict[str, Any]], list[tuple[bytes, bytes]]] | None:
        """The response refusing a request without the right key; None lets it through.

        Every path but `open_paths` needs it: /tokenize burns CPU and /reset_prefix_cache
        flushes the cache. Two Authorization headers are refused outright rather than letting
        one of them win (a proxy may have added one).
        """
        given = [v for k, v in raw_headers if k == b"authorization"]
        if len(given) > 1:
            return (400, error_body("Send one Authorization header, not several.",
                                    "BadRequestError", 400)), []
        if not self.api_key or path in self.open_paths:
            return None
        if given and hmac.compare_digest(given[0], f"Bearer {self.api_key}".encode()):
            return None
        return (401, error_body(
            "Unauthorized: send a valid API key as 'Authorization: Bearer <key>'.",
            "AuthenticationError", 401)), [(b"www-authenticate", b"Bearer")]

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any,
                       declared: int) -> None:
        seen = 0
        exceeded = False
        started = False
        # A large body is read and parsed under the heap's body settings (serve/http/heap.py).
        large = declared >= LARGE_BODY_BYTES
        if large:
            self.heap.large_body_begins()

        async def limited_receive() -> dict[str, Any]:
            # Counts body bytes as the app reads them: a chunked upload declares no length.
            nonlocal seen, exceeded, large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen >= LARGE_BODY_BYTES and not large:
                    large = True
                    self.heap.large_body_begins()
                if seen > self.max_body_bytes:
                    exceeded = True
                    raise ValueError("request body too large")
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            # Past the limit FastAPI answers 400 "error parsing the body": swallowed, for a 413.
            nonlocal started
            if exceeded:
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as e:  # noqa: BLE001 - the last resort: answer, log, keep the connection
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started and not exceeded:
                await _send_json(send, (500, error_body(str(e), "InternalServerError", 500)))
                return
        finally:
            self.heap.request_ends(large)  # the body and what was parsed from it are garbage
        if exceeded:
            await _send_json(send, self._too_large())

    def _too_large(self) -> tuple[int, dict[str, Any]]:
        return 413, error_body(f"Request body is larger than {self.max_body_bytes} bytes.",
                               "RequestTooLargeError", 413)


async def _send_json(send: Any, response: tuple[int, dict[str, Any]],
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    status, body = response
    data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
