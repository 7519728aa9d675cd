"""The server's connection edges (serve/http_protocol.py): header and body deadlines, the
connection cap, keep-alive, JSON errors from the HTTP parser, HEAD /health.

One real server with short deadlines; raw sockets play the slow and malformed clients.
"""
from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from server_utils import HTTP_TIMEOUT_S, RemoteServer

TIMEOUT_S = 2.0  # --header-timeout and --body-timeout
CAP = 120  # --limit-concurrency
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny",
        "--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S),
        "--timeout-keep-alive", str(TIMEOUT_S), "--limit-concurrency", str(CAP)]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_model_dir, ARGS)
    yield s
    s.close()


def connect(server: RemoteServer, payload: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=HTTP_TIMEOUT_S)
    if payload:
        sock.sendall(payload)
    return sock


def read_until_closed(socks: list[socket.socket], deadline_s: float) -> dict[int, tuple[float, bytes]]:
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


def status_and_body(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def assert_json_error(raw: bytes, status: int) -> dict[str, object]:
    code, headers, body = status_and_body(raw)
    assert code == status, raw[:300]
    assert headers["content-type"].startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_stalled_clients_are_closed_while_real_requests_succeed(server: RemoteServer) -> None:
    silent = [connect(server) for _ in range(20)]
    in_headers = [connect(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
                  for _ in range(40)]
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    in_body = [connect(server, (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                                + body[:5]).encode()) for _ in range(40)]
    results: list[int] = []

    def real_requests() -> None:
        with server.http() as http:
            for _ in range(4):
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                                        "max_tokens": 3, **IGNORE_EOS})
                results.append(r.status_code)

    worker = threading.Thread(target=real_requests)
    worker.start()
    closed = read_until_closed(silent + in_headers + in_body, TIMEOUT_S + 8)
    worker.join(HTTP_TIMEOUT_S)
    assert results == [200] * 4
    assert len(closed) == 100, f"{100 - len(closed)} stalled connections are still open"
    slowest = max(t for t, _ in closed.values())
    assert slowest < TIMEOUT_S + 3, slowest
    for i, (_, raw) in closed.items():
        if i < 20:
            continue  # sent nothing: a 408 or a bare close are both fine
        err = assert_json_error(raw, 408)
        assert ("--header-timeout" if i < 60 else "--body-timeout") in str(err["message"])
    for s in silent + in_headers + in_body:
        s.close()


def test_keep_alive_connection_outlives_the_deadlines(server: RemoteServer) -> None:
    """Deadlines count per request: a connection reused across pauses shorter than the
    keep-alive timeout is served for longer than any deadline."""
    with httpx.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S) as http:
        for _ in range(3):
            assert http.get("/health").status_code == 200
            time.sleep(TIMEOUT_S * 0.6)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def test_a_stream_longer_than_the_deadlines_is_not_cut(server: RemoteServer) -> None:
    """A client that reads a stream slowly keeps it open past every deadline."""
    start = time.monotonic()
    with server.client().completions.create(model="tiny", prompt="Once", max_tokens=20,
                                            stream=True, extra_body=IGNORE_EOS) as stream:
        reasons = []
        for chunk in stream:
            time.sleep(TIMEOUT_S * 1.5 / 20)
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "length" and len(reasons) >= 20
    assert time.monotonic() - start > TIMEOUT_S * 1.5


def test_connections_over_the_cap_get_503(server: RemoteServer) -> None:
    held = [connect(server) for _ in range(CAP)]
    try:
        time.sleep(0.3)  # the server accepts them
        sock = connect(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = read_until_closed([sock], 5.0)[0][1]
        err = assert_json_error(raw, 503)
        assert "--limit-concurrency" in str(err["message"])
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(server.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert server.metrics().get("vllm:num_requests_rejected_total",
                                reason="connection_limit") >= 1


@pytest.mark.parametrize("raw", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
    b"NOT A REQUEST\r\n\r\n",
], ids=["nul-in-header", "two-content-lengths", "bad-chunk-size", "garbage"])
def test_http_parser_errors_are_json(server: RemoteServer, raw: bytes) -> None:
    sock = connect(server, raw)
    out = read_until_closed([sock], 5.0)[0][1]
    assert_json_error(out, 400)
    sock.close()


def test_head_health(server: RemoteServer) -> None:
    r = httpx.head(server.url + "/health", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.content == b""
