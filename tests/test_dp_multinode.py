"""Data-parallel engines over several nodes (`serve -dp 2 --nnodes 2`; frontend/remote_engines.py,
engine/dp_headless.py, engine/channel.py; issues 30 part 3 and 52), two launches on this machine
standing in for two: node 0 the API server with engine 0, node 1 a headless launch with engine
1. Requests reach both engines and give one process's tokens; the server's stop ends node 1
with 0; a dead engine, a lost node or a SIGTERMed node fails its requests and stops the server
with 1; no process is left behind. An engine without the shared secret is refused, and the
watch of silent nodes is unit-tested in-process."""
from __future__ import annotations

import os
import queue
import re
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from server_utils import RemoteServer, free_port
from test_dp_serving import SHORT_PROMPT, _Stream
from test_tp_multinode import _alive, _Launch, _wait_gone

from chunkserve.cli import main
from chunkserve.engine.channel import SECRET_ENV
from chunkserve.engine.engine_loop import LoopEvent
from chunkserve.procs.rendezvous import host_store

SHUTDOWN_TIMEOUT_S = 3.0
FLAGS = ["--dtype", "float32", "--max-num-batched-tokens", "64", "--nnodes", "2",
         "--master-addr", "127.0.0.1"]


@pytest.fixture(autouse=True)
def _shared_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node of these launches is given the same secret, as a deployment would."""
    monkeypatch.setenv(SECRET_ENV, "test-secret-of-the-nodes")


class _Nodes:
    """Node 1's headless launch, started first, and node 0's server, which waits for it."""

    def __init__(self, model: str, node1_flags: tuple[str, ...] = ()) -> None:
        port = str(free_port())
        self.node1 = _Launch([sys.executable, "-m", "chunkserve.cli", "serve", model, "-dp", "2",
                              "--node-rank", "1", "--master-port", port, *FLAGS, *node1_flags])
        self.server: RemoteServer | None = None
        try:
            self.server = RemoteServer(model, ["-dp", "2", "--master-port", port, *FLAGS,
                                               "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
            self.engine1 = self.node1.pids()[0]  # the engine process of node 1
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.node1.proc.poll() is None:
            self.node1.proc.kill()
            self.node1.proc.wait()


@pytest.fixture
def nodes(tiny_model_dir: str) -> Iterator[_Nodes]:
    started = _Nodes(tiny_model_dir, ("--max-num-seqs", "7"))  # node 0's flags win
    yield started
    started.close()


def _both_engines_streaming(server: RemoteServer) -> list[_Stream]:
    streams = [_Stream(server, SHORT_PROMPT) for _ in range(2)]
    for s in streams:
        s.first_token()
    m = server.metrics()  # the second request went to the idle engine, on the other node
    assert m.get("vllm:num_requests_running", engine="0") == 1
    assert m.get("vllm:num_requests_running", engine="1") == 1
    return streams


def test_engines_on_two_nodes_serve_as_one_and_stop_with_the_server(
        nodes: _Nodes, tiny_model_dir: str) -> None:
    from chunkserve.llm import LLM
    from chunkserve.sampling_params import SamplingParams

    server = nodes.server
    assert server is not None and server.proc is not None
    streams = _both_engines_streaming(server)
    assert [s.finish() for s in streams] == [None, None]
    one = LLM(model=tiny_model_dir, dtype="float32", max_num_batched_tokens=64,
              num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        expected = one.generate(SHORT_PROMPT, params)[0].outputs[0].text
    finally:
        one.engine.close()
    assert streams[0].text == streams[1].text == expected
    assert server.metrics().get("vllm:generation_tokens_total") == 600  # summed over nodes

    assert server.terminate() == 0
    assert nodes.node1.proc.wait(15) == 0, nodes.node1.output()
    _wait_gone([nodes.engine1])
    assert "node 0's are used" in nodes.node1.output()  # its --max-num-seqs differed


def test_a_dead_engine_on_another_node_fails_its_requests_and_stops_both(
        nodes: _Nodes) -> None:
    server = nodes.server
    assert server is not None and server.proc is not None
    streams = _both_engines_streaming(server)
    os.kill(nodes.engine1, signal.SIGKILL)
    errors = [s.finish() for s in streams]
    died = [e for e in errors if e and "engine 1 died: its process on node 1 exited with "
                                       "code -9" in e]
    assert len(died) == 1, errors
    assert server.proc.wait(SHUTDOWN_TIMEOUT_S + 10) == 1
    assert nodes.node1.proc.wait(15) == 1, nodes.node1.output()


def test_a_silent_node_is_noticed_and_leaves_no_engine(nodes: _Nodes) -> None:
    """A SIGKILLed launch closes no socket of the server's: its engine exits (its parent is
    gone), and the server hears of it from the node's beat counter standing still."""
    from chunkserve.frontend.remote_engines import NODE_SILENT_S

    server = nodes.server
    assert server is not None and server.proc is not None
    nodes.node1.proc.kill()
    _wait_gone([nodes.engine1])
    assert server.proc.wait(NODE_SILENT_S + SHUTDOWN_TIMEOUT_S + 10) == 1
    assert "node 1 stopped answering" in server.log_tail()


def test_a_sigtermed_node_fails_its_requests_and_exits_0(nodes: _Nodes) -> None:
    server = nodes.server
    assert server is not None and server.proc is not None
    streams = _both_engines_streaming(server)
    nodes.node1.proc.send_signal(signal.SIGTERM)
    errors = [s.finish() for s in streams]
    assert sum("node 1 is shutting down" in (e or "") for e in errors) == 1, errors
    assert nodes.node1.proc.wait(15) == 0, nodes.node1.output()
    assert server.proc.wait(SHUTDOWN_TIMEOUT_S + 10) == 1
    assert not _alive(nodes.engine1)


def test_a_node_with_another_layout_stops_both_with_one_line(tiny_model_dir: str) -> None:
    port = str(free_port())
    node1 = _Launch([sys.executable, "-m", "chunkserve.cli", "serve", tiny_model_dir, "-dp",
                     "4", "--node-rank", "1", "--master-port", port, *FLAGS])
    node0 = _Launch([sys.executable, "-m", "chunkserve.cli", "serve", tiny_model_dir, "-dp",
                     "2", "--master-port", port, "--port", str(free_port()), *FLAGS])
    try:
        assert node1.proc.wait(60) == 2 and node0.proc.wait(60) == 2
    finally:
        for launch in (node0, node1):
            if launch.proc.poll() is None:
                launch.proc.kill()
    why = "node 1 was started with --data-parallel-size 4 --nnodes 2, node 0 with 2 and 2"
    assert re.search(f"chunkserve: error: {why}", node1.output())
    assert re.search(f"chunkserve: error: engine 1 \\(node 1\\) failed to start: {why}",
                     node0.output())


@pytest.mark.parametrize("flags, message", [
    (["-dp", "3", "--nnodes", "2", "--master-port", "29500"],
     "--data-parallel-size 3 must divide evenly by --nnodes 2"),
    (["-dp", "2", "--master-port", "29500"], "with --data-parallel-size on one node it has "
                                              "no use"),
    (["-dp", "0"], "--data-parallel-size must be at least 1"),
])
def test_bad_flags_are_one_line_errors(flags: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_an_engine_refuses_data_parallel_size(tiny_model_dir: str) -> None:
    from chunkserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="chunkserve serve --data-parallel-size"):
        LLMEngine.from_kwargs(model=tiny_model_dir, data_parallel_size=2)


def test_node_watch_reports_a_node_that_never_joins_or_goes_silent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkserve.engine.dp_rendezvous import beat_key
    from chunkserve.frontend import remote_engines as dp_remote
    from chunkserve.frontend.core_client import CoreClient, EngineHub
    from chunkserve.frontend.remote_engines import NodeWatch

    monkeypatch.setattr(dp_remote, "BEAT_S", 0.05)
    monkeypatch.setattr(dp_remote, "NODE_SILENT_S", 0.3)
    monkeypatch.setattr(dp_remote, "TIMEOUT", timedelta(seconds=0.5))
    store = host_store("127.0.0.1", None, 0)
    hub = EngineHub(b"secret", tcp=True)
    never, silent = (CoreClient(hub, i, None, node=i) for i in (1, 2))
    NodeWatch(store, [never, silent], "is it started?")
    events: queue.Queue[LoopEvent] = queue.Queue()
    silent.start(lambda index, ev: events.put(ev))
    for _ in range(5):  # node 2 beats a while, then stops
        store.add(beat_key(2), 1)
        time.sleep(0.05)
    with pytest.raises(ValueError, match=r"engine 1 \(node 1\) could not start: node 1 did "
                                         r"not join within 0.5 s: is it started\?"):
        never.wait_ready(timeout=10)
    assert events.get(timeout=10).fatal == "node 2 stopped answering for 0.3 s"
    assert not silent.is_alive() and not never.is_alive()
    for client in (never, silent):
        client.shutdown(timeout=1)  # the last one closes the hub's sockets and reader
