"""Scheduling must never change what a greedy request generates.

Chunk budget, policy, batch neighbours and preemption (recompute or swap) only change *when*
tokens are computed; the tokens themselves must be identical to generating each prompt alone.
"""
from __future__ import annotations

import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.engine.trace import read_trace
from chunkserve.model.factory import LoadedModel, load_model

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(n_tokens: list[int]) -> list[list[int]]:
    # Deterministic, varied token ids well inside the vocabulary.
    return [[(7919 * (i + 1) + 104729 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate(n_tokens)]


def _generate(loaded: LoadedModel, prompts: list[list[int]], **kwargs: object) -> tuple[list, LLM]:
    llm = LLM(loaded=loaded, dtype="float32", **kwargs)
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> LoadedModel:
    return load_model(tiny_model_dir, "float32", max_model_len=256)


def _alone(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt generated alone, in one whole-prompt step."""
    ref = []
    for p in prompts:
        tokens, _ = _generate(loaded, [p], model=loaded.path, max_num_batched_tokens=4096)
        ref.append(tokens[0])
    assert all(len(t) == MAX_TOKENS for t in ref)
    return ref


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    return _prompts([5, 23, 40, 70, 150])


@pytest.fixture(scope="module")
def tiny_reference(tiny: LoadedModel, tiny_prompts: list[list[int]]) -> list[list[int]]:
    return _alone(tiny, tiny_prompts)


@pytest.fixture(scope="module")
def crowded_prompts() -> list[list[int]]:
    # 248 prompt tokens fill 16 blocks of 16 exactly, and lengths of 15 mod 16 leave each last
    # block one slot short: once all are running, every decode soon needs a block nobody has.
    return _prompts([31, 31, 31, 31, 31, 31, 47, 15])


@pytest.fixture(scope="module")
def crowded_reference(tiny: LoadedModel, crowded_prompts: list[list[int]]) -> list[list[int]]:
    return _alone(tiny, crowded_prompts)


@pytest.mark.parametrize("scheduler", ["decode-first", "vllm-v1"])
@pytest.mark.parametrize("budget", [16, 32, 64, 4096])
def test_chunked_policies_match_alone(tiny, tiny_prompts, tiny_reference, scheduler, budget):
    tokens, _ = _generate(
        tiny, tiny_prompts, model=tiny.path, scheduler=scheduler, max_num_batched_tokens=budget
    )
    assert tokens == tiny_reference


@pytest.mark.parametrize("scheduler", ["prefill-first", "orca"])
@pytest.mark.parametrize("budget", [256, 4096])  # no-chunk budgets must hold max_model_len
def test_no_chunk_policies_match_alone(tiny, tiny_prompts, tiny_reference, scheduler, budget):
    tokens, _ = _generate(
        tiny, tiny_prompts, model=tiny.path, scheduler=scheduler, max_num_batched_tokens=budget
    )
    assert tokens == tiny_reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("scheduler,budget", [
    ("decode-first", 32), ("decode-first", 64), ("vllm-v1", 32), ("prefill-first", 256),
    ("orca", 256),
])
def test_forced_preemption_matches_alone(
    tiny, crowded_prompts, crowded_reference, mode, scheduler, budget, tmp_path
):
    trace = str(tmp_path / "steps.jsonl")
    tokens, llm = _generate(
        tiny, crowded_prompts, model=tiny.path, scheduler=scheduler, max_num_batched_tokens=budget,
        num_kv_blocks=16, preemption_mode=mode, trace_file=trace,
    )
    llm.engine.close()
    assert llm.engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert any(r.num_swapped_blocks for r in read_trace(trace))
    assert tokens == crowded_reference
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


# ---- the real model: fewer combinations, same property --------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_fp32: LoadedModel) -> LoadedModel:
    return smollm2_fp32  # float32, 512 positions (conftest: one load a session)


def test_smollm2_chunking_and_preemption_keep_tokens(smollm2: LoadedModel):
    prompts = [
        smollm2.tokenizer.encode(t)
        for t in [
            "The history of the printing press begins in",
            "def fibonacci(n):\n    ",
            "Chunked prefill splits long prompts into pieces so that " * 3,
        ]
    ]
    ref = _alone(smollm2, prompts)  # each prompt alone, whole (a budget of 4096)
    # Each run chunks the 37-token prompt (at a budget of 16, then of 32) beside the others'
    # decodes, and 4 blocks of 16 hold one request of max_model_len: preemption is forced, by
    # recompute and by swap. (The other schedulers and budgets, preemption or not: the tiny
    # model's tests above, on the same code paths.)
    for kwargs in [
        dict(max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=4),
        dict(max_num_batched_tokens=32, max_model_len=64, num_kv_blocks=4, preemption_mode="swap"),
    ]:
        tokens, llm = _generate(smollm2, prompts, model=smollm2.path, **kwargs)
        assert tokens == ref, kwargs
        assert llm.engine.scheduler.num_preemptions > 0, kwargs


# ---- prefix caching: hits change only what is recomputed, never the tokens ------------------
def _shared_prefix_prompts() -> list[list[int]]:
    """Prompts sharing a 40-token system prefix (2 full blocks of 16 + 8), one repeated
    verbatim (a whole-prompt hit recomputes its last token), one ending exactly on a block
    boundary of another, and one with no shared prefix."""
    (system,) = _prompts([40])
    tails = _prompts([9, 30, 17, 1])
    return [
        system + tails[0],
        system + tails[1],
        system + tails[0],  # verbatim repeat of the first
        system[:32],  # exactly two cached blocks, nothing else
        system + tails[2] + tails[3],
        tails[1],  # unrelated
    ]


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    return _shared_prefix_prompts()


@pytest.fixture(scope="module")
def shared_reference(tiny: LoadedModel, shared_prompts: list[list[int]]) -> list[list[int]]:
    return _alone(tiny, shared_prompts)


def _twice(loaded: LoadedModel, prompts: list[list[int]], **kwargs: object) -> tuple[list, list, LLM]:
    """Generates the batch twice on one engine: the second pass hits what the first cached."""
    llm = LLM(loaded=loaded, dtype="float32", model=loaded.path, **kwargs)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    second_outs = llm.generate(prompts, GREEDY)
    return first, [o.outputs[0].token_ids for o in second_outs], llm


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("scheduler,budget", [
    ("decode-first", 16), ("decode-first", 48), ("decode-first", 4096), ("vllm-v1", 32),
    ("prefill-first", 256), ("orca", 256),
])
def test_prefix_caching_on_and_off_match_alone(
    tiny, shared_prompts, shared_reference, caching, scheduler, budget
):
    first, second, llm = _twice(
        tiny, shared_prompts, scheduler=scheduler, max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    assert first == shared_reference
    assert second == shared_reference
    stats = llm.engine.scheduler.kv.prefix_stats
    if caching:
        assert stats.hits > 0
    else:
        assert stats.hits == 0 and stats.queries == 0
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("scheduler,budget", [("decode-first", 32), ("vllm-v1", 32), ("orca", 256)])
def test_prefix_caching_with_forced_preemption_matches_alone(
    tiny, shared_prompts, shared_reference, mode, scheduler, budget
):
    # 12 blocks of 16: the 6 prompts (~240 tokens + output) cannot all run at once. The pool
    # must still hold one max-length request, hence max_model_len 128 (the prompts fit it).
    first, second, llm = _twice(
        tiny, shared_prompts, scheduler=scheduler, max_num_batched_tokens=budget,
        num_kv_blocks=12, preemption_mode=mode, max_model_len=128,  # the pool must hold one
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.prefix_stats.hits > 0
    assert first == shared_reference and second == shared_reference
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("caching", [True, False])
def test_aborts_with_prefix_caching_keep_other_tokens(tiny, shared_prompts, shared_reference, caching):
    """Aborting requests mid-prefill and mid-decode releases their shared blocks without
    disturbing the others; a later request reusing the aborted one's cached blocks still
    generates the reference tokens."""
    llm = LLM(loaded=tiny, dtype="float32", model=tiny.path, max_num_batched_tokens=24,
              enable_prefix_caching=caching)
    engine = llm.engine
    ids = [engine.add_request(None, p, GREEDY) for p in shared_prompts]
    tokens: dict[str, list[int]] = {}
    for step in range(40):
        if step == 2:
            engine.abort_request(ids[1])  # mid-prefill
        if step == 12:
            engine.abort_request(ids[4])  # mid-decode (or late prefill)
        for out in engine.step().outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
    for i, rid in enumerate(ids):
        if i not in (1, 4):
            assert tokens[rid] == shared_reference[i], i
    again = llm.generate([shared_prompts[1], shared_prompts[4]], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [shared_reference[1], shared_reference[4]]
    assert engine.scheduler.kv.stats().num_used_blocks == 0


def test_num_cached_tokens_reported_per_request(tiny, shared_prompts):
    llm = LLM(loaded=tiny, dtype="float32", model=tiny.path)
    (first,) = llm.generate([shared_prompts[0]], GREEDY)
    assert first.num_cached_tokens == 0
    (second,) = llm.generate([shared_prompts[1]], GREEDY)
    assert second.num_cached_tokens == 32  # the two full blocks of the 40-token system prompt
