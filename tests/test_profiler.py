"""vLLM's profiler endpoints (issue 32): POST /start_profile and /stop_profile with
`--profiler-dir`, torch.profiler over the engine thread's steps, one Chrome trace per engine and
stop; 404 without the flag, 400 out of order, the API key as on every admin endpoint, and a bad
directory refused before any model loads."""
from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from server_utils import HTTP_TIMEOUT_S, RemoteServer, assert_error

from chunkserve.cli import main as cli_main
from chunkserve.engine.profiler import ProfilerStateError, engine_profiler
from chunkserve.frontend.async_engine import AsyncEngine, EngineDeadError
from chunkserve.engine.engine_loop import LoopError, LoopEvent, StartProfile, StopProfile

API_KEY = "profiler-key"
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32",
        "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Not created: the server makes it.
    return str(tmp_path_factory.mktemp("profiles") / "traces")


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, trace_dir: str) -> Iterator[RemoteServer]:
    s = RemoteServer(tiny_model_dir, [*ARGS, "--profiler-dir", trace_dir], api_key=API_KEY)
    yield s
    s.close()


def _traces(trace_dir: str) -> list[str]:
    return sorted(f for f in os.listdir(trace_dir) if f.endswith(".pt.trace.json"))


def _events(path: str) -> list[dict[str, object]]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert isinstance(events, list) and events
    return events


def test_profile_writes_a_chrome_trace_of_the_steps(server: RemoteServer,
                                                    trace_dir: str) -> None:
    http = server.http()
    assert _traces(trace_dir) == []
    assert_error(http.post("/stop_profile"), 400, "BadRequestError", "not running")

    r = http.post("/start_profile")
    assert (r.status_code, r.content) == (200, b"")
    assert_error(http.post("/start_profile"), 400, "BadRequestError", "already running")
    out = server.client().completions.create(model="tiny", prompt="Once upon a time",
                                             max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    r = http.post("/stop_profile")
    assert (r.status_code, r.content) == (200, b"")

    [first] = _traces(trace_dir)
    assert first.startswith("engine0.")
    names = {e.get("name") for e in _events(os.path.join(trace_dir, first))}
    # The steps ran under the profiler, on the thread that started it.
    assert any(isinstance(n, str) and n.startswith("engine_step#") for n in names)

    # A second profile gets a file of its own; the profiler is off again after each stop.
    assert http.post("/start_profile").status_code == 200
    assert http.post("/stop_profile").status_code == 200
    files = _traces(trace_dir)
    assert len(files) == 2 and first in files
    _events(os.path.join(trace_dir, files[1] if files[0] == first else files[0]))
    assert_error(http.post("/stop_profile"), 400, "BadRequestError")


def test_profiler_endpoints_need_the_api_key(server: RemoteServer) -> None:
    for path in ("/start_profile", "/stop_profile"):
        r = httpx.post(server.url + path, headers={"Authorization": "Bearer wrong"},
                       timeout=HTTP_TIMEOUT_S)
        assert_error(r, 401, "AuthenticationError")


def test_without_a_profiler_dir_both_endpoints_are_404(tiny_model_dir: str) -> None:
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.serve.app import build_app

    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", max_model_len=256)
    try:
        client = TestClient(build_app(engine, "tiny"))  # routing only: no lifespan, no loop
        for path in ("/start_profile", "/stop_profile"):
            assert_error(client.post(path), 404, "NotFoundError")  # type: ignore[arg-type]
    finally:
        engine.close()


def test_a_file_as_profiler_dir_is_refused_before_loading(
        tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_dir = tmp_path / "file.txt"  # type: ignore[operator]
    not_a_dir.write_text("x")
    # A model that does not exist: had it been loaded first, the error would name it.
    argv = ["serve", "/nonexistent/model", "--profiler-dir", str(not_a_dir)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"chunkserve: error: --profiler-dir '{not_a_dir}' is not a directory"

    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(not_a_dir))
    assert cli_main(argv[:2]) == 2
    assert "VLLM_TORCH_PROFILER_DIR" in capsys.readouterr().err


class _Client:
    """An engine client that records commands; the test plays its loop's answers."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.info = SimpleNamespace(block_size=16, processor=None)
        self.sent: list[object] = []
        self.handle: Callable[[int, LoopEvent], None] | None = None

    def start(self, handle: Callable[[int, LoopEvent], None]) -> None:
        self.handle = handle

    def send(self, command: object) -> None:
        self.sent.append(command)

    def answer(self, error: BaseException | None = None) -> None:
        token = self.sent[-1].token  # type: ignore[attr-defined]
        assert self.handle is not None
        answer = None if error is None else LoopError.of(error)
        self.handle(self.index, LoopEvent(profile_answers=[(token, answer)]))

    def is_alive(self) -> bool:
        return True

    def shutdown(self, timeout: float) -> None:
        pass


def test_data_parallel_engines_each_answer_before_the_endpoint_does() -> None:
    """Each engine of a --data-parallel-size server profiles itself: the call waits for every
    one, raises a refusal from any, and fails if an engine dies before answering."""

    async def main() -> None:
        clients = [_Client(0), _Client(1)]
        ae = AsyncEngine(clients)  # type: ignore[arg-type]
        ae.start()
        started = asyncio.ensure_future(ae.start_profile())
        await asyncio.sleep(0.01)
        assert [type(c.sent[-1]) for c in clients] == [StartProfile, StartProfile]
        clients[0].answer()
        await asyncio.sleep(0.01)
        assert not started.done()
        clients[1].answer()
        await asyncio.wait_for(started, 1)

        stopped = asyncio.ensure_future(ae.stop_profile())
        await asyncio.sleep(0.01)
        assert [type(c.sent[-1]) for c in clients] == [StopProfile, StopProfile]
        clients[0].answer()
        clients[1].answer(ProfilerStateError("not running"))
        with pytest.raises(ProfilerStateError, match="not running"):
            await asyncio.wait_for(stopped, 1)

        waiting = asyncio.ensure_future(ae.start_profile())
        await asyncio.sleep(0.01)
        clients[0].answer()
        assert clients[1].handle is not None
        clients[1].handle(1, LoopEvent(fatal="its process exited"))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiting, 1)

    asyncio.run(main())


def test_each_engine_names_its_traces() -> None:
    assert engine_profiler(None, 0) is None
    profiler = engine_profiler("/tmp", 3)
    assert profiler is not None and profiler.name == "engine3"
