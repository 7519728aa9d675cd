"""Which cores each rank and engine computes on (procs/cpu_binding.py): vLLM's
VLLM_CPU_OMP_THREADS_BIND lists, nobind, the default even split, the data-parallel engines'
shares, and a real two-rank engine bound as asked and unbound after."""
from __future__ import annotations

import os

import pytest

from chunkserve.procs.cpu_binding import (
    ENV, RESERVED_ENV, engine_cpus, parse_cpu_list, rank_cores, reserved_cpus, threads,
)
from chunkserve.engine.core_proc import split_cores


def test_cpu_lists_parse_like_taskset() -> None:
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list(" 5 ") == (5,)
    for bad in ("a", "3-1", "-2", "1-", ""):
        with pytest.raises(ValueError, match=ENV):
            parse_cpu_list(bad)


def test_ranks_split_the_cores_unless_told() -> None:
    assert rank_cores(2, "auto", [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert rank_cores(2, "", [0, 1, 2]) == [(0,), (1,)]  # none slower than another
    assert rank_cores(3, "auto", [4, 5]) == [(4,), (5,), (4,)]  # fewer cores: shared
    assert rank_cores(2, "nobind") == [None, None]
    assert rank_cores(2, "0-3|8,9") == [(0, 1, 2, 3), (8, 9)]
    with pytest.raises(ValueError, match="2 CPU set.*3 tensor-parallel rank"):
        rank_cores(3, "0|1")
    assert threads((4, 5, 6), 2) == 3
    assert threads(None, len(os.sched_getaffinity(0))) == 1


def test_data_parallel_engines_take_their_ranks_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0|1|2-3|4")
    assert split_cores(2, tp=2) == [((0, 1), "0|1"), ((2, 3, 4), "2,3|4")]
    with pytest.raises(ValueError, match="4 CPU set.*3 engines"):
        split_cores(3, tp=2)
    monkeypatch.delenv(ENV)
    shares = [cores for cores, bind in split_cores(2)]
    assert len(shares) == 2 and all(shares)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_reserved_cpus_are_the_api_server_s_and_the_engines_split_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(RESERVED_ENV, raising=False)
    assert reserved_cpus() == () and engine_cpus() == cpus
    monkeypatch.setenv(RESERVED_ENV, "1")  # vLLM's: the last one is the server's
    assert reserved_cpus() == (cpus[-1],) and engine_cpus() == cpus[:-1]
    assert split_cores(1) == [(tuple(cpus[:-1]), None)]
    for bad, message in ((str(len(cpus)), "the engines need at least one"),
                         ("two", "not a number")):
        monkeypatch.setenv(RESERVED_ENV, bad)
        with pytest.raises(ValueError, match=message):
            reserved_cpus()


def _allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":")[1].strip() for line in f
                    if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_each_rank_runs_on_the_cores_it_was_given(tiny_model_dir: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from chunkserve.engine.llm_engine import LLMEngine

    first, second = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv(ENV, f"{second}|{first}")  # reversed: the list is what counts
    before, threads_before = os.sched_getaffinity(0), torch.get_num_threads()
    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", quantization="none",
                                   tensor_parallel_size=2, max_num_batched_tokens=16,
                                   num_kv_blocks=32)
    try:
        worker = engine.executor.workers[0]  # type: ignore[attr-defined]
        assert os.sched_getaffinity(0) == {second} and torch.get_num_threads() == 1
        assert _allowed(worker.pid) == str(first)
    finally:
        engine.close()
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads_before
