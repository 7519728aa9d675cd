"""uvicorn's HTTP/1.1 protocol (h11) with the edges a public server needs.

uvicorn times out only the idle wait *between* requests (`timeout_keep_alive`). A client that
opens a connection and sends nothing, stalls in the middle of its headers, or declares a body
and never sends it, held its connection and its file descriptor for ever: 5,000 of them were
accepted without an API key (the key is checked once the headers are in). So this subclass
adds, per connection:

- a header deadline: the request line and headers must be complete within `header_timeout`
  seconds of the connection opening or of the request's first byte (408, then close);
- a body deadline: the declared body must arrive within `body_timeout` of the headers (408);
- a connection cap: a connection opened while `limit_concurrency` others are open gets a 503
  in OpenAI's shape for its request and is closed (uvicorn's own cap answers in plain text);
- errors from the HTTP parser (a NUL byte in a header, a bad chunk size, two Content-Length
  headers) answered as JSON instead of text/plain.

None of the deadlines runs while the response is being written, so a long stream is never
cut. We subclass h11's protocol rather than httptools': it is pure Python, always installed
with uvicorn, and exposes its parser state (`their_state`), which the deadlines key off.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from chunkserve.serve.http.errors import error_body

log = logging.getLogger("chunkserve.server")


@dataclass(frozen=True)
class ConnectionLimits:
    """The server's connection edges (flags of the same names; None disables one)."""

    header_timeout: float | None = 10.0
    body_timeout: float | None = 60.0
    limit_concurrency: int | None = 1024
    # Called once per connection refused by the cap (the rejected-requests counter).
    on_reject: Callable[[str], None] | None = None


def _json_bytes(status: int, err_type: str, message: str) -> bytes:
    return json.dumps(error_body(message, err_type, status)).encode("utf-8")


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, written past h11: a timeout
    can fire in states where h11 will not let a server speak (no request line yet)."""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app a connection over the cap gets for its request."""
    body = _json_bytes(503, "ServiceUnavailableError",
                       "The server has too many open connections (--limit-concurrency). "
                       "Retry later.")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class EdgeH11Protocol(H11Protocol):
    """Set `limits` on a subclass (`protocol_class`); uvicorn builds one per connection."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: Any = None  # h11's their_state the running deadline watches
        self._over_cap = False

    # ---- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.limit_concurrency
        if cap is not None and len(self.connections) > cap:
            self._over_cap = True
            self.app = _over_capacity
            if self.limits.on_reject is not None:
                self.limits.on_reject("connection_limit")
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._over_cap and len(self.connections) <= (self.limits.limit_concurrency or 0):
            # Others closed before this connection sent its request: serve it after all.
            self._over_cap = False
            self.app = self.config.loaded_app
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # The idle wait for the next request is uvicorn's keep-alive timer; the header deadline
        # starts again with the next request's first byte (data_received).
        self._cancel_deadline()
        super().on_response_complete()

    # ---- deadlines --------------------------------------------------------------------------
    def _watch(self) -> None:
        """Arms the deadline that fits where the request is; keeps a running one (a deadline
        counts from the phase's start, so trickling bytes does not extend it)."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm(self.limits.header_timeout, state, "Timed out waiting for the request "
                      "headers (--header-timeout).")
        elif state is h11.SEND_BODY:
            self._arm(self.limits.body_timeout, state, "Timed out waiting for the request "
                      "body (--body-timeout).")
        else:
            self._cancel_deadline()

    def _arm(self, timeout: float | None, state: Any, message: str) -> None:
        if self._deadline_for is state:
            return
        self._cancel_deadline()
        if timeout is None:
            return
        self._deadline_for = state
        self._deadline = self.loop.call_later(timeout, self._expire, message)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._deadline_for = None

    def _expire(self, message: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        if cycle is not None and cycle.response_started:
            self.transport.close()  # the app answered already; only the socket is left
            return
        if cycle is not None:
            # The app is waiting on the body: it reads a disconnect and its sends are dropped,
            # so nothing it does can follow the 408 onto the wire.
            cycle.disconnected = True
            cycle.message_event.set()
        log.info("closing a connection from %s: %s", self.client, message)
        self.transport.write(_raw_response(408, "Request Timeout",
                                           _json_bytes(408, "RequestTimeoutError", message)))
        self.transport.close()

    # ---- parser errors ----------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """uvicorn's reply to a request h11 cannot parse, in OpenAI's JSON shape."""
        self._cancel_deadline()
        body = _json_bytes(400, "BadRequestError", msg)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            out = self.conn.send(h11.Response(status_code=400, headers=headers,
                                              reason=b"Bad Request"))
            out = (out or b"") + (self.conn.send(h11.Data(data=body)) or b"")
            out += self.conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:  # h11 will not answer in this state: write it raw
            out = _raw_response(400, "Bad Request", body)
        self.transport.write(out)
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[EdgeH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...), carrying these limits."""
    return type("ChunkserveH11Protocol", (EdgeH11Protocol,), {"limits": limits})
