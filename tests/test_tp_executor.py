"""Tensor parallelism on the CPU (engine/tp/executor.py, engine/tp/group.py, model/tp_layers.py; issue
30 part 1): two ranks over gloo in spawned processes, each holding its shard, give the same
greedy tokens as one process under chunked prefill, prefix caching and both preemption modes,
with KV heads split or replicated; they stop cleanly, and a worker that dies turns the next
step into an error, not a hang."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from chunkserve.engine.llm_engine import LLMEngine, StepError
from chunkserve.engine.tp.executor import TensorParallelExecutor
from chunkserve.engine.tp.group import Rendezvous, TPGroup
from chunkserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHARED = [(17 * i + 3) % 400 + 5 for i in range(32)]  # two blocks every prompt below shares
PROMPTS = [SHARED + [(31 * i + 7) % 400 + 5 for i in range(n)] for n in (12, 1, 30)] + \
          [[(13 * i + 2) % 400 + 5 for i in range(9)]]


def _tokens(engine: LLMEngine) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def _same_tokens(model: str, **kwargs: object) -> LLMEngine:
    """Runs PROMPTS on one process and on two ranks; returns the two-rank engine, closed."""
    import torch

    args = dict(model=model, dtype="float32", **{"quantization": "none", **kwargs})
    one = LLMEngine.from_kwargs(**args)
    threads = torch.get_num_threads()
    two = LLMEngine.from_kwargs(tensor_parallel_size=2, **args)
    try:
        assert _tokens(two) == _tokens(one), kwargs
        assert two.scheduler.num_preemptions == one.scheduler.num_preemptions
    finally:
        two.close()
    assert torch.get_num_threads() == threads  # rank 0's share given back to the process
    assert [w.exitcode for w in two.executor.workers] == [0]  # type: ignore[attr-defined]
    return two


@pytest.mark.parametrize("kwargs", [
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(max_num_batched_tokens=16, num_kv_blocks=6, max_model_len=96,
         preemption_mode="recompute"),
    dict(max_num_batched_tokens=16, num_kv_blocks=6, max_model_len=96, preemption_mode="swap"),
], ids=["budget16-caching", "budget64", "recompute", "swap"])
def test_two_ranks_give_one_process_tokens(tiny_model_dir: str, kwargs: dict) -> None:
    """The tiny Llama (4 query heads, 2 KV heads: one KV head a rank), float32 weights."""
    two = _same_tokens(tiny_model_dir, num_kv_blocks=kwargs.pop("num_kv_blocks", 64), **kwargs)
    sched = two.scheduler
    if "preemption_mode" in kwargs:
        assert sched.num_preemptions > 0
    elif kwargs.get("enable_prefix_caching", True):
        assert sched.kv.prefix_stats.hits > 0


# Each C group GEMM: the host's own, and the AVX2 build, which every x86-64-v3 host runs (the
# worker processes inherit CHUNKSERVE_CPU_ISA).
ISAS = ["native", "avx2"]


def _on_isa(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkserve.model.layers import group_gemm

    monkeypatch.setenv("CHUNKSERVE_CPU_ISA", isa)
    if group_gemm.available() is None:
        pytest.skip("no C group GEMM (AVX2) here: PyTorch's bfloat16 partial sums differ")


@pytest.mark.parametrize("isa", ISAS)
def test_int8_weights_give_the_same_tokens(tiny_model_dir: str, isa: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 in groups of 32 (the C group GEMMs): each rank quantizes its shard, in groups the
    split never cuts, and a float32 model's partial sums stay float32 into the all-reduce (the
    avx2 kernel rounds a rank's activations per group of 32 too, the groups one process has).
    (Per-channel int8, PyTorch's kernel where no C kernel builds, holds one process's levels
    on every rank too (test_tp_sharding.py), but rounds each rank's partial sums to bfloat16
    before the all-reduce: not compared token for token.)"""
    _on_isa(isa, monkeypatch)
    _same_tokens(tiny_model_dir, max_num_batched_tokens=16, num_kv_blocks=64,
                 quantization="int8")


@pytest.mark.parametrize("isa", ISAS)
def test_int4_weights_give_the_same_tokens(tiny_model_dir: str, isa: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 in groups of 32 inputs (GGUF's Q4_1 blocks): the row-parallel splits of o_proj and
    down fall on group boundaries (32 and 64 inputs a rank here), so each rank holds exactly
    one process's groups, and the C kernels' float32 partial sums add up alike."""
    _on_isa(isa, monkeypatch)
    _same_tokens(tiny_model_dir, max_num_batched_tokens=16, num_kv_blocks=64,
                 quantization="int4")


def test_logprobs_agree_within_float32_rounding(tiny_model_dir: str) -> None:
    """The gathered logits themselves: every prompt position's top-5 log-probs (prompt
    logprobs) and each sampled token's, two ranks against one, float32."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    outs = []
    for tp in (1, 2):
        engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32",
                                       quantization="none", tensor_parallel_size=tp,
                                       max_num_batched_tokens=16, num_kv_blocks=64)
        try:
            engine.add_request("r", PROMPTS[0], params)
            while engine.has_unfinished_requests():
                for out in engine.step().outputs:
                    if out.finished:
                        outs.append(out)
        finally:
            engine.close()
    one, two = outs
    pairs = [(a, b) for a, b in zip(one.prompt_logprobs, two.prompt_logprobs) if a is not None]
    pairs += list(zip(one.outputs[0].logprobs, two.outputs[0].logprobs))
    assert len(pairs) == len(PROMPTS[0]) - 1 + 4
    for a, b in pairs:
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    """The tiny Llama with a single KV head (replicated on both ranks) and a tied head."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-mqa")
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_key_value_heads, config.tie_word_embeddings = 1, True
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return str(path)


def test_a_replicated_kv_head_gives_the_same_tokens(one_kv_head_dir: str) -> None:
    _same_tokens(one_kv_head_dir, max_num_batched_tokens=16, num_kv_blocks=64)


def test_a_size_that_does_not_split_the_heads_is_refused(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide 4"):
        LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", tensor_parallel_size=3,
                              max_num_batched_tokens=16)


def test_a_dead_worker_is_an_error_not_a_hang(tiny_model_dir: str) -> None:
    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", quantization="none",
                                   tensor_parallel_size=2, max_num_batched_tokens=16,
                                   num_kv_blocks=64)
    executor = engine.executor
    assert isinstance(executor, TensorParallelExecutor)
    worker = executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
    worker.join(10)
    engine.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(StepError) as failed:  # the engine's: the caller aborts its requests
        engine.step()
    assert failed.value.request_ids == ["r"]
    assert "tp-rank-1 exited with code -9" in str(failed.value.__cause__)
    assert not any(w.is_alive() for w in executor.workers)
    engine.close()


def test_group_broadcasts_objects_sums_and_gathers() -> None:
    """Two ranks in threads of this process."""
    import torch

    store = TPGroup.host_store("127.0.0.1", 2)
    rendezvous = Rendezvous("127.0.0.1", store.port, 2)
    got: dict[object, object] = {}

    def rank1() -> None:
        group = TPGroup(rendezvous, 1)
        got[1] = group.broadcast_bytes()
        got["sum"] = group.all_reduce(torch.tensor([2.0, 3.0])).tolist()
        got["gather"] = [t.tolist() for t in group.all_gather(torch.tensor([9]))]

    thread = threading.Thread(target=rank1)
    thread.start()
    group = TPGroup(rendezvous, 0, store)
    group.broadcast_bytes(b"step 1 2 3")
    total = group.all_reduce(torch.tensor([1.0, 1.0])).tolist()
    gathered = [t.tolist() for t in group.all_gather(torch.tensor([8]))]
    thread.join(30)
    assert got[1] == b"step 1 2 3" and total == got["sum"] == [3.0, 4.0]
    assert gathered == got["gather"] == [[8], [9]]


def test_one_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 ranks"):
        TensorParallelExecutor(None, 1)  # type: ignore[arg-type]


def test_the_adaptive_policy_probes_on_every_rank(tiny_model_dir: str, caplog) -> None:
    """The adaptive policy's start-up probe runs its steps on the tensor-parallel group (a
    probe on rank 0 alone would hang the others' collectives); the engine then plans with the
    fit and gives one process's greedy tokens."""
    import logging

    from chunkserve import LLM
    from chunkserve.sim.online_model import OnlineCostModel

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = dict(model=tiny_model_dir, dtype="float32", quantization="none",
                  max_model_len=256)
    one = LLM(**common)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    one.engine.close()
    with caplog.at_level(logging.INFO, logger="chunkserve.engine.llm_engine"):
        llm = LLM(tensor_parallel_size=2, chunk_policy="adaptive", **common)
    try:
        assert isinstance(llm.engine.step_model, OnlineCostModel)
        assert "adaptive on the engine's own step-time model (probed" in caplog.text
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert got == expected
    finally:
        llm.engine.close()
