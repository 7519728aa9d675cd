"""The server's connection edges (serve/http/h11_protocol.py): header and body deadlines, the
connection cap, keep-alive, JSON errors from the HTTP parser, HEAD /health.

One real server with short deadlines; raw sockets play the slow and malformed clients
(stress/slow_clients.py, whose phase `make stress` runs at a larger scale).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from server_utils import HTTP_TIMEOUT_S
from stress.report import PhaseResult, render_table
from stress.slow_clients import check_cap, check_stalls, connect, json_error, read_until_closed
from stress.target import Target

TIMEOUT_S = 2.0  # --header-timeout and --body-timeout
CAP = 120  # --limit-concurrency
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny",
        "--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S),
        "--timeout-keep-alive", str(TIMEOUT_S), "--limit-concurrency", str(CAP)]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[Target]:
    t = Target(tiny_model_dir, ARGS, max_waiting=0)
    yield t
    t.close()


def assert_ok(result: PhaseResult) -> None:
    assert not result.violations, render_table([result], result.violations)


def test_stalled_clients_are_closed_while_real_requests_succeed(server: Target) -> None:
    result = PhaseResult("stalls")
    check_stalls(server, 100, TIMEOUT_S, result)
    assert_ok(result)
    assert result.statuses[200] == 4


def test_keep_alive_connection_outlives_the_deadlines(server: Target) -> None:
    """Deadlines count per request: a connection reused across pauses shorter than the
    keep-alive timeout is served for longer than any deadline."""
    with httpx.Client(base_url=server.url, headers=server.headers,
                      timeout=HTTP_TIMEOUT_S) as http:
        for _ in range(3):
            assert http.get("/health").status_code == 200
            time.sleep(TIMEOUT_S * 0.6)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def test_a_stream_longer_than_the_deadlines_is_not_cut(server: Target) -> None:
    """A client that reads a stream slowly keeps it open past every deadline."""
    start = time.monotonic()
    with server.server.client().completions.create(
            model="tiny", prompt="Once", max_tokens=20, stream=True, extra_body=IGNORE_EOS,
            stream_options={"include_usage": True}) as stream:
        reasons, usage = [], None
        for chunk in stream:
            time.sleep(TIMEOUT_S * 1.5 / 20)
            if chunk.choices:
                reasons.append(chunk.choices[0].finish_reason)
            usage = chunk.usage or usage
    # Every token came (counted by the server: a token that ends inside a UTF-8 character
    # has no text of its own, so its text rides on the next chunk and chunks may be fewer).
    assert reasons[-1] == "length" and usage is not None and usage.completion_tokens == 20
    assert time.monotonic() - start > TIMEOUT_S * 1.5


def test_connections_over_the_cap_get_503(server: Target) -> None:
    result = PhaseResult("cap", allow_503=True)
    check_cap(server, CAP, result)
    assert_ok(result)
    time.sleep(0.3)
    assert httpx.get(server.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert server.server.metrics().get("vllm:num_requests_rejected_total",
                                       reason="connection_limit") >= 1


@pytest.mark.parametrize("raw", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
    b"NOT A REQUEST\r\n\r\n",
], ids=["nul-in-header", "two-content-lengths", "bad-chunk-size", "garbage"])
def test_http_parser_errors_are_json(server: Target, raw: bytes) -> None:
    sock = connect(server.port, raw)
    out = read_until_closed([sock], 5.0)[0][1]
    sock.close()
    status, err = json_error(out)
    assert status == 400 and err is not None, out[:300]


def test_head_health(server: Target) -> None:
    r = httpx.head(server.url + "/health", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.content == b""
