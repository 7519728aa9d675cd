"""Phase (f): slow and idle clients, and the connection cap (serve/http/h11_protocol.py).

Connections that send nothing, stall inside their headers, or stall inside a declared body must
be closed by the server within --header-timeout / --body-timeout (plus slack), with a 408 in
OpenAI's shape where a request had begun, while real requests on other connections succeed.
Then `cap` idle connections are held open and one more gets a 503 for its request.
"""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import httpx

from stress.report import PhaseResult
from stress.target import Target

SLACK_S = 3.0  # the deadline is a timer on a busy event loop, plus the read loop's poll


def connect(port: int, payload: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if payload:
        sock.sendall(payload)
    return sock


def read_until_closed(socks: list[socket.socket], deadline_s: float
                      ) -> dict[int, tuple[float, bytes]]:
    """Reads every socket until the server closes it; {index: (seconds to close, bytes)}."""
    start = time.monotonic()
    sel = selectors.DefaultSelector()
    data: dict[int, bytes] = {}
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        data[i] = b""
    closed: dict[int, tuple[float, bytes]] = {}
    while len(closed) < len(socks) and time.monotonic() - start < deadline_s:
        for key, _ in sel.select(timeout=0.2):
            i = key.data
            try:
                chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except ConnectionResetError:
                chunk = b""
            if chunk:
                data[i] += chunk
            else:
                closed[i] = (time.monotonic() - start, data[i])
                sel.unregister(key.fileobj)
    sel.close()
    return closed


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of one raw HTTP/1.1 response; status 0 if none."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/"):
        return 0, {}, raw
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def json_error(raw: bytes) -> tuple[int, dict[str, object] | None]:
    """(status, the OpenAI error object or None when the body is not one)."""
    status, headers, body = parse_response(raw)
    try:
        err = json.loads(body)["error"]
        ok = (headers.get("content-type", "").startswith("application/json")
              and set(err) == {"message", "type", "param", "code"} and err["code"] == status)
    except (ValueError, KeyError, TypeError):
        ok = False
    return status, err if ok else None


def stalled_connections(target: Target, num: int) -> tuple[list[socket.socket], list[str]]:
    """`num` connections in three kinds of stall: silent, mid-headers, mid-body. The body stall
    carries the API key: without it the server answers 401 before reading any body."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    auth = "".join(f"{k}: {v}\r\n" for k, v in target.headers.items())
    in_headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    in_body = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body[:5]}").encode()
    kinds = [("silent", b""), ("headers", in_headers), ("body", in_body)]
    socks, labels = [], []
    for i in range(num):
        label, payload = kinds[i % 3]
        socks.append(connect(target.port, payload))
        labels.append(label)
    return socks, labels


def _real_requests(target: Target, num: int, statuses: list[int]) -> None:
    with httpx.Client(base_url=target.url, headers=target.headers, timeout=60) as http:
        for _ in range(num):
            r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3,
                                                    "ignore_eos": True})
            statuses.append(r.status_code)


def check_stalls(target: Target, num: int, timeout_s: float, result: PhaseResult) -> None:
    socks, labels = stalled_connections(target, num)
    statuses: list[int] = []
    worker = threading.Thread(target=_real_requests, args=(target, 4, statuses))
    worker.start()
    closed = read_until_closed(socks, timeout_s + SLACK_S + 5)
    worker.join(60)
    for s in socks:
        s.close()
    for status in statuses:
        result.record(status)
    if statuses != [200] * 4:
        result.fail(f"real requests beside the stalled connections got {statuses}")
    if len(closed) < num:
        result.fail(f"{num - len(closed)} of {num} stalled connections still open after "
                    f"{timeout_s + SLACK_S + 5:.0f} s")
    late = [t for t, _ in closed.values() if t > timeout_s + SLACK_S]
    if late:
        result.fail(f"{len(late)} stalled connections closed late (slowest {max(late):.1f} s)")
    for i, (_, raw) in closed.items():
        if labels[i] == "silent":
            continue  # nothing was sent: a bare close is as good as a 408
        status, err = json_error(raw)
        if status != 408 or err is None:
            result.fail(f"a connection stalled in its {labels[i]} got {raw[:120]!r}, not a 408")
    slowest = max((t for t, _ in closed.values()), default=0.0)
    result.notes.append(f"{len(closed)}/{num} stalled connections closed, the last after "
                        f"{slowest:.1f} s (timeout {timeout_s:g} s)")


def check_cap(target: Target, cap: int, result: PhaseResult) -> None:
    held = [connect(target.port) for _ in range(cap)]
    try:
        time.sleep(0.3)  # let the server accept them
        sock = connect(target.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = read_until_closed([sock], 10.0).get(0, (0.0, b""))[1]
        sock.close()
    finally:
        for s in held:
            s.close()
    status, err = json_error(raw)
    result.record(status)
    if status != 503 or err is None:
        result.fail(f"a connection over --limit-concurrency {cap} got {raw[:120]!r}, not a 503")


def run_slow_clients(target: Target, num: int, timeout_s: float, cap: int) -> PhaseResult:
    result = PhaseResult("slow clients", allow_503=True)
    start = time.monotonic()
    check_stalls(target, num, timeout_s, result)
    time.sleep(0.5)
    check_cap(target, cap, result)
    result.seconds = time.monotonic() - start
    return result
