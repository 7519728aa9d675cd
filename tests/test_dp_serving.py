"""`serve --data-parallel-size` (issue 30): engine processes behind one API server, routed,
labelled in /metrics, and stopped with the server; a dead engine or tensor-parallel worker
fails its requests, stops the server with a non-zero status, and leaves no process behind.

The routing rule itself is unit-tested in test_dp_router.py; these run real servers on the tiny
random Llama (one core per engine here, so they stay small).
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from server_utils import HTTP_TIMEOUT_S, RemoteServer


SHORT_PROMPT = "Once upon a time"  # under one KV block: no prefix affinity, routed by load
LONG = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
SHUTDOWN_TIMEOUT_S = 3.0


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:  # fields: state, ppid, ...
                kids.append(int(entry))
    return kids


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for kid in _children(todo.pop()):
            out.append(kid)
            todo.append(kid)
    return out


def _workers(pid: int) -> list[int]:
    """The spawned engine processes and tensor-parallel workers under `pid` (not the
    multiprocessing resource tracker)."""
    found = []
    for kid in _descendants(pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(kid)
        except OSError:
            pass
    return found


def _assert_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")
                 and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes left behind: {alive}"
        time.sleep(0.1)


class _Stream:
    """A streamed completion read chunk by chunk, so a test can act while it runs."""

    def __init__(self, server: RemoteServer, prompt: str) -> None:
        self._client = httpx.Client(timeout=HTTP_TIMEOUT_S)
        body = {"model": server.model, "prompt": prompt, "stream": True, **LONG}
        self._cm = self._client.stream("POST", server.url + "/v1/completions", json=body)
        self._lines = self._cm.__enter__().iter_lines()
        self.text = ""

    def first_token(self) -> None:
        self._read(until_text=True)

    def finish(self) -> str | None:
        """Reads to the end: the error message if the stream ended with one."""
        try:
            return self._read(until_text=False)
        finally:
            self._cm.__exit__(None, None, None)
            self._client.close()

    def _read(self, until_text: bool) -> str | None:
        for line in self._lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]["message"]
            self.text += event["choices"][0]["text"]
            if until_text and self.text:
                return None
        return None


def _dp_server(model: str, tp: int) -> RemoteServer:
    return RemoteServer(model, ["-dp", "2", "-tp", str(tp), "--dtype", "float32",
                                "--max-num-batched-tokens", "64",
                                "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])


@pytest.fixture
def dp_tp_server(tiny_model_dir: str) -> Iterator[RemoteServer]:
    # DP x TP: two engines of two ranks each, four processes on this machine's cores.
    server = _dp_server(tiny_model_dir, tp=2)
    yield server
    server.close()


@pytest.fixture
def dp_server(tiny_model_dir: str) -> Iterator[RemoteServer]:
    server = _dp_server(tiny_model_dir, tp=1)
    yield server
    server.close()


def test_two_engines_share_the_load_and_stop_with_the_server(dp_tp_server: RemoteServer
                                                             ) -> None:
    server = dp_tp_server
    assert server.proc is not None
    procs = _workers(server.proc.pid)
    assert len(procs) == 4  # two engine processes, each with one tensor-parallel worker
    streams = [_Stream(server, SHORT_PROMPT) for _ in range(2)]
    for s in streams:
        s.first_token()
    m = server.metrics()
    # The second request went to the idle engine; gauges carry an engine label.
    assert m.get("vllm:num_requests_running", engine="0") == 1
    assert m.get("vllm:num_requests_running", engine="1") == 1
    assert [s.finish() for s in streams] == [None, None]
    # The same greedy tokens from either engine.
    assert streams[0].text == streams[1].text and streams[0].text
    m = server.metrics()
    assert m.get("vllm:generation_tokens_total") == 2 * LONG["max_tokens"]  # summed counters
    assert m.get("vllm:request_success_total", finished_reason="length") == 2

    started = time.monotonic()
    assert server.terminate() == 0
    assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S + 2
    _assert_gone(procs)


def test_a_dead_engine_fails_its_requests_and_stops_the_server(dp_server: RemoteServer
                                                               ) -> None:
    server = dp_server
    assert server.proc is not None
    streams = [_Stream(server, SHORT_PROMPT) for _ in range(2)]
    for s in streams:
        s.first_token()
    procs = _workers(server.proc.pid)
    engines = [p for p in _children(server.proc.pid) if p in procs]
    assert len(engines) == 2 == len(procs)
    os.kill(engines[1], signal.SIGKILL)
    errors = [s.finish() for s in streams]
    # The dead engine's request ends with an error event. The other engine's runs on into the
    # shutdown grace period: it completes, or is cut at its end, with an error of its own.
    died = [e for e in errors if e is not None and "died" in e]
    assert len(died) == 1, errors
    assert all(e is None or e == died[0] or "shutting down" in e for e in errors), errors
    try:
        assert httpx.get(server.url + "/health", timeout=2).status_code == 503
    except httpx.TransportError:
        pass  # already stopped listening: the server is on its way out
    assert server.proc.wait(SHUTDOWN_TIMEOUT_S + 10) == 1
    _assert_gone(procs)


def test_a_dead_tensor_parallel_worker_stops_the_server(tiny_model_dir: str) -> None:
    server = RemoteServer(tiny_model_dir, ["-tp", "2", "--dtype", "float32",
                                           "--max-num-batched-tokens", "64",
                                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    try:
        assert server.proc is not None
        stream = _Stream(server, SHORT_PROMPT)
        stream.first_token()
        procs = _workers(server.proc.pid)
        assert len(procs) == 1
        os.kill(procs[0], signal.SIGKILL)
        error = stream.finish()
        assert error is not None and "tensor-parallel worker" in error
        assert server.proc.wait(SHUTDOWN_TIMEOUT_S + 10) == 1
        _assert_gone(procs)
    finally:
        server.close()


def test_one_engine_in_its_own_process_keeps_a_core_for_the_server(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's arrangement (issue 53): VLLM_ENABLE_V1_MULTIPROCESSING=1 runs the one engine in a
    process of its own, and VLLM_CPU_NUM_OF_RESERVED_CPU=1 keeps the last CPU for the server."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    server = RemoteServer(tiny_model_dir, ["--dtype", "float32"])
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=HTTP_TIMEOUT_S,
                       json={"model": server.model, "prompt": SHORT_PROMPT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert server.proc is not None
        engines = _workers(server.proc.pid)
        assert len(engines) == 1
        assert _allowed(engines[0]) == ",".join(map(str, cpus[:-1]))  # the engine's
        assert _allowed(server.proc.pid) == str(cpus[-1])  # the server's main thread
        assert server.terminate() == 0
        _assert_gone(engines)
    finally:
        server.close()


def _allowed(pid: int) -> str:
    """The CPUs a process's main thread may run on, as a comma-separated list."""
    return ",".join(map(str, sorted(os.sched_getaffinity(pid))))


@pytest.mark.parametrize("name, value, message", [
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "yes", "VLLM_ENABLE_V1_MULTIPROCESSING='yes': 0"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU", "many", "is not a number of CPUs"),
])
def test_bad_placement_variables_are_one_line_errors(
        name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from chunkserve.cli import main

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv(name, value)
    assert main(["serve", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1
