"""Tensor parallelism over several nodes (--nnodes, --node-rank, --master-addr, --master-port;
engine/tp/headless.py, engine/tp/worker.py; issue 30 part 3), two launches on this machine standing
in for two: node 1 a headless `chunkserve serve` subprocess, node 0 this process (or a
subprocess, to be killed). The same greedy tokens as one process; rank 0's stop ends node 1
with 0, rank 0's death with 1; a SIGKILLed launcher or engine leaves no worker behind; bad
flag combinations are one-line errors."""
from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from server_utils import free_port
from test_tp_executor import GREEDY, PROMPTS, _tokens

from chunkserve.cli import main
from chunkserve.engine.llm_engine import LLMEngine

ENGINE = dict(dtype="float32", quantization="none", max_num_batched_tokens=16, num_kv_blocks=64)
# Node 0 in a process of its own: rank 0 and (with -tp 4) its worker rank 1, then it waits.
NODE0 = """
import json, sys, time
from chunkserve.engine.llm_engine import LLMEngine
engine = LLMEngine.from_kwargs(model=sys.argv[1], tensor_parallel_size=4, nnodes=2,
                               master_port=int(sys.argv[2]), **json.loads(sys.argv[3]))
print("ready, pids", *[w.pid for w in engine.executor.workers], file=sys.stderr, flush=True)
time.sleep(600)
"""


class _Launch:
    """A subprocess whose stderr lines are read as they come."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def pids(self, pattern: str = r"pids ([\d ]+)", timeout: float = 60.0) -> list[int]:
        """The pids the launch reports in its first line matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.log.append(self.lines.get(timeout=0.5))
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.log)
                continue
            if match := re.search(pattern, self.log[-1]):
                return [int(p) for p in match.group(1).split()]
        raise AssertionError("no line matching %r in:\n%s" % (pattern, "".join(self.log)))

    def output(self) -> str:
        while not self.lines.empty():
            self.log.append(self.lines.get())
        return "".join(self.log)


def _headless(model: str, port: int, tp: int = 2) -> _Launch:
    return _Launch([sys.executable, "-m", "chunkserve.cli", "serve", model, "-tp", str(tp),
                    "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "--dtype", "float32"])


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's exit is reaped by init, which may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes left behind"


@pytest.fixture
def launches() -> Iterator[list[_Launch]]:
    """Launches to clean up, should a test fail half-way."""
    started: list[_Launch] = []
    yield started
    for launch in started:
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.proc.wait()


def test_two_nodes_give_one_process_tokens(tiny_model_dir: str, launches: list[_Launch]
                                           ) -> None:
    """Node 1 takes rank 0's flags (its own --quantization differs, with a warning); rank 0's
    close stops it: exit 0, no worker left."""
    port = free_port()
    launches.append(node1 := _headless(tiny_model_dir, port))
    worker = node1.pids()
    one = LLMEngine.from_kwargs(model=tiny_model_dir, **ENGINE)
    two = LLMEngine.from_kwargs(model=tiny_model_dir, tensor_parallel_size=2, nnodes=2,
                                master_port=port, **ENGINE)
    try:
        assert two.executor.workers == []  # type: ignore[attr-defined]
        assert _tokens(two) == _tokens(one)
    finally:
        two.close()
    assert node1.proc.wait(15) == 0, node1.output()
    _wait_gone(worker)
    assert "node 0's are used" in node1.output()


def test_a_killed_headless_launch_leaves_no_worker(tiny_model_dir: str,
                                                   launches: list[_Launch]) -> None:
    """Its worker sees its parent gone (rank 0 alive, so no socket closes to tell it); rank
    0's next step is then an error, not a hang, and one that stops the engine."""
    from chunkserve.engine.executor import FatalExecutorError

    port = free_port()
    launches.append(node1 := _headless(tiny_model_dir, port))
    worker = node1.pids()
    two = LLMEngine.from_kwargs(model=tiny_model_dir, tensor_parallel_size=2, nnodes=2,
                                master_port=port, **ENGINE)
    node1.proc.kill()
    _wait_gone(worker)
    two.add_request("r", PROMPTS[0], GREEDY)
    t0 = time.monotonic()
    with pytest.raises(Exception) as failed:
        while two.has_unfinished_requests():
            two.step()
    assert time.monotonic() - t0 < 10
    chain = [failed.value, failed.value.__cause__]
    assert any(isinstance(e, FatalExecutorError) for e in chain), chain
    assert "the tensor-parallel group failed" in " ".join(map(str, chain))
    two.close()


def test_a_killed_engine_stops_every_node(tiny_model_dir: str, launches: list[_Launch]) -> None:
    """-tp 4 on two nodes: SIGKILL the engine's process (node 0, rank 0 and its worker);
    its worker and node 1's two are gone, and node 1 exits 1."""
    port = free_port()
    launches.append(node1 := _headless(tiny_model_dir, port, tp=4))
    node1_workers = node1.pids()
    launches.append(node0 := _Launch([sys.executable, "-c", NODE0, tiny_model_dir, str(port),
                                      json.dumps(ENGINE)]))
    node0_workers = node0.pids(r"ready, pids ([\d ]+)")
    assert len(node0_workers) == 1 and len(node1_workers) == 2
    node0.proc.kill()
    _wait_gone(node0_workers)
    assert node1.proc.wait(10) == 1, node1.output()
    assert "exited with code 1" in node1.output()
    _wait_gone(node1_workers)


def test_sigterm_stops_a_headless_launch(launches: list[_Launch]) -> None:
    """Before rank 0 ever shows up (its worker still trying to reach the store)."""
    launches.append(node1 := _headless("smollm2-135m", free_port()))
    worker = node1.pids()
    node1.proc.send_signal(signal.SIGTERM)
    assert node1.proc.wait(10) == 0, node1.output()
    _wait_gone(worker)


MULTI_NODE_ERRORS = [
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1"],
     "--nnodes 2 needs an explicit --master-port"),
    (["-tp", "3", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500"],
     "--tensor-parallel-size 3 must divide evenly by --nnodes 2"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500"],
     r"--node-rank must be in \[0, 2\) for --nnodes 2, got 2"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500",
      "--master-addr", "0.0.0.0"],
     "--master-addr 0.0.0.0 is not an address other nodes can connect to"),
]


@pytest.mark.parametrize("command, flags, message", [
    ("generate", ["--nnodes", "0"], r"nnodes \(--nnodes\) must be at least 1"),
    ("generate", ["--master-port", "70000"], r"--master-port must be in \[0, 65535\]"),
    *[("generate", flags, message) for flags, message in MULTI_NODE_ERRORS],
    *[("serve", flags, message) for flags, message in MULTI_NODE_ERRORS],
])
def test_bad_flags_are_one_line_errors(command: str, flags: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`serve` and `generate`, on node 0 or a headless node, before starting anything."""
    argv = [command, *flags] + (["--prompt", "x"] if command == "generate" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and len(err.splitlines()) == 1


def test_node_ranks_are_placed_in_order() -> None:
    from chunkserve.config import ParallelConfig

    nodes = [ParallelConfig(8, 4, k, "10.0.0.1", 29500) for k in range(4)]
    assert [list(n.node_ranks) for n in nodes] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_secondary_node_runs_no_engine_and_a_taken_port_is_reported(
        tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="--node-rank 1 runs no engine"):
        LLMEngine.from_kwargs(model=tiny_model_dir, tensor_parallel_size=2, nnodes=2,
                              node_rank=1, master_port=29500, **ENGINE)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        with pytest.raises(OSError, match="rank 0's store cannot listen on 127.0.0.1:"):
            LLMEngine.from_kwargs(model=tiny_model_dir, tensor_parallel_size=2,
                                  master_port=taken.getsockname()[1], **ENGINE)


def test_an_idle_worker_outwaits_the_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker waits for the next step past TIMEOUT (a server idle for minutes, a headless
    node started long before the first request); the step's collectives keep TIMEOUT."""
    from datetime import timedelta

    from chunkserve.engine.tp import group as tp_group
    from chunkserve.engine.tp.group import IDLE_WAIT, Rendezvous, TPGroup

    monkeypatch.setattr(tp_group, "TIMEOUT", timedelta(seconds=0.5))
    store = TPGroup.host_store("127.0.0.1", 2)
    rendezvous = Rendezvous("127.0.0.1", store.port, 2)
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(
        TPGroup(rendezvous, 1).broadcast_bytes(timeout=IDLE_WAIT)))
    worker.start()
    group = TPGroup(rendezvous, 0, store)
    time.sleep(1.5)
    group.broadcast_bytes(b"step")
    worker.join(10)
    assert got == [b"step"]
