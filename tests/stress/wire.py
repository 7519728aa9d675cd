"""A raw HTTP/1.1 client on one keep-alive connection (h11), so that resets can be counted.

An ordinary client pool hides a dropped keep-alive connection by quietly opening another one;
the defect this suite guards against was exactly that: after a 500 the server closed the
connection, and the client's next request on it failed. Here a connection that dies under a
request, or is closed by the server without `Connection: close`, counts as a reset.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

import h11

IDLE_REUSE_S = 2.0  # uvicorn closes idle connections after 5 s; reconnect well before that


class Reset(Exception):
    """The connection died under a request."""


@dataclass
class WireResponse:
    status: int
    headers: dict[str, str]
    body: bytes


class KeepAliveClient:
    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.addr = (host, port)
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.conn: h11.Connection | None = None
        self.last_used = 0.0
        self.reused = False  # the current request goes over an already-used connection

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.conn = None

    def _connect(self) -> None:
        self.close()
        self.sock = socket.create_connection(self.addr, timeout=self.timeout)
        self.conn = h11.Connection(h11.CLIENT)
        self.reused = False

    def request(self, method: str, path: str, body: bytes | Iterable[bytes] = b"",
                headers: dict[str, str] | None = None, send_body: bool = True) -> WireResponse:
        """Sends one request; raises Reset when the connection drops before the response ends.

        send_body=False sends the headers only (a declared length too large to send) and reads
        the answer given before the body; the connection is then unusable and is closed.
        """
        fresh_needed = (self.conn is None or self.conn.our_state is not h11.IDLE
                        or time.monotonic() - self.last_used > IDLE_REUSE_S)
        if fresh_needed:
            self._connect()
        else:
            self.reused = True
        assert self.sock is not None and self.conn is not None
        # Header values as latin-1 bytes: HTTP allows any octet there, h11 only ASCII str.
        hdrs: list[tuple[str, str | bytes]] = [
            ("host", f"{self.addr[0]}:{self.addr[1]}"),
            *((k, v.encode("latin-1")) for k, v in (headers or {}).items()),
        ]
        chunked = not isinstance(body, bytes)
        if chunked:
            hdrs.append(("transfer-encoding", "chunked"))
        elif not any(k.lower() == "content-length" for k, _ in hdrs):
            hdrs.append(("content-length", str(len(body))))
        request = h11.Request(method=method, target=path, headers=hdrs)  # ours to get right
        try:
            self._send(request)
            if send_body:
                for part in ([body] if not chunked else body):  # type: ignore[list-item]
                    if part:
                        self._send(h11.Data(data=part))
                self._send(h11.EndOfMessage())
            response = self._read_response()
        except (OSError, h11.RemoteProtocolError, Reset) as e:
            self.close()
            raise Reset(f"{type(e).__name__}: {e}") from e
        self.last_used = time.monotonic()
        if not send_body:
            self.close()
        elif self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return response

    def _send(self, event: h11.Event) -> None:
        assert self.sock is not None and self.conn is not None
        data = self.conn.send(event)
        if data:
            self.sock.sendall(data)

    def _read_response(self) -> WireResponse:
        assert self.sock is not None and self.conn is not None
        status, headers, body = 0, {}, bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(65536)
                if not data:
                    raise Reset("connection closed before the response ended")
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return WireResponse(status, headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                raise Reset("connection closed before the response ended")
