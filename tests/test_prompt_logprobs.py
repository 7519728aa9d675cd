"""prompt_logprobs (vLLM's): per prompt token, its logprob and the top ones, whatever the chunking.

The reference is one forward of the whole prompt through the model (no KV cache, no engine):
log_softmax of the logits at position p gives prompt token p + 1's entry.
"""
from __future__ import annotations

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.model.factory import LoadedModel, load_model

K = 3
ATOL = 1e-4


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7919 * (salt + 1) + 104729 * j) % 40000 + 100 for j in range(n)]


PROMPT = _prompt(45)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> LoadedModel:
    return load_model(tiny_model_dir, "float32", max_model_len=256)


def _reference(tiny: LoadedModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-probs from one whole-prompt forward on a scratch KV cache."""
    from chunkserve.engine.model_runner import ModelRunner
    from chunkserve.core.request import Request
    from chunkserve.core.sched_output import ScheduledRequest

    block = 16
    nblocks = -(-len(prompt) // block)
    runner = ModelRunner(tiny.model, nblocks, block, enforce_eager=True)
    req = Request("ref", prompt, SamplingParams(), 0.0)
    sr = ScheduledRequest(req, len(prompt), 0, False, [list(range(nblocks))], True)
    with torch.inference_mode():
        hidden = runner.hidden_states([sr])
        return tiny.model.compute_logits(hidden).float().log_softmax(dim=-1)


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> torch.Tensor:
    return _reference(tiny, PROMPT)


def _params(k: int | None = K, n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=k)


def _check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = prompt_logprobs[i]
        assert entry is not None, i
        row = ref[i - 1]
        token, lp = entry[0]
        assert token == prompt[i]
        assert abs(lp - float(row[token])) < ATOL, (i, lp, float(row[token]))
        top = entry[1:]
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = row.topk(k)
        assert [t for t, _ in top] == ref_ids.tolist(), i
        assert all(abs(v - r) < ATOL for v, r in zip(values, ref_values.tolist()))


def test_reference_is_a_distribution(reference):
    # Sanity of the reference itself: rows are normalized log-probs.
    assert torch.allclose(reference.exp().sum(-1), torch.ones(len(PROMPT)), atol=1e-4)


@pytest.mark.parametrize("budget", [16, 32, 128])
def test_prompt_logprobs_match_one_forward_for_any_chunking(tiny, reference, budget):
    llm = LLM(loaded=tiny, model=tiny.path, dtype="float32", max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    out = llm.generate([PROMPT], _params())[0]
    _check(out.prompt_logprobs, PROMPT, reference)
    # k = 0: the prompt token's own entry only, as the sampler's logprobs=0.
    zero = llm.generate([PROMPT], _params(0))[0].prompt_logprobs
    assert zero[0] is None and all(len(e) == 1 for e in zero[1:])
    assert [e[0] for e in zero[1:]] == [e[0] for e in out.prompt_logprobs[1:]]


def test_every_output_carries_them_and_others_get_none(tiny, reference):
    llm = LLM(loaded=tiny, model=tiny.path, dtype="float32", max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("asks", PROMPT, _params(n=4))
    engine.add_request("plain", _prompt(30, salt=5), _params(None, n=4))
    seen: dict[str, list] = {"asks": [], "plain": []}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            seen[out.request_id].append(out)
    assert len(seen["asks"]) == 4 and len(seen["plain"]) == 4
    for out in seen["asks"]:  # streaming: complete from the first token on
        _check(out.prompt_logprobs, PROMPT, reference)
    assert all(out.prompt_logprobs is None for out in seen["plain"])


def test_batched_askers_with_different_k_and_small_logit_slices(tiny, reference):
    llm = LLM(loaded=tiny, model=tiny.path, dtype="float32", max_num_batched_tokens=64,
              enable_prefix_caching=False)
    llm.engine.executor.PROMPT_LOGPROBS_ROWS = 7  # slices that straddle the two requests
    second = _prompt(20, salt=3)
    a, b = llm.generate([PROMPT, second], [_params(1), _params(5)])
    _check(a.prompt_logprobs, PROMPT, reference, k=1)
    _check(b.prompt_logprobs, second, _reference(tiny, second), k=5)
    # A one-token prompt has nothing to predict: [None].
    assert llm.generate([[500]], _params())[0].prompt_logprobs == [None]


def test_no_extra_logits_for_requests_that_did_not_ask(tiny):
    llm = LLM(loaded=tiny, model=tiny.path, dtype="float32", max_num_batched_tokens=16)
    model = tiny.model
    rows: list[int] = []
    orig = model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return orig(hidden)

    model.compute_logits = counting  # type: ignore[method-assign]
    try:
        llm.generate([PROMPT], _params(None, n=2))
    finally:
        del model.compute_logits
    assert rows == [1, 1]  # the sampling row of the last chunk and of the decode


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(tiny, reference):
    llm = LLM(loaded=tiny, model=tiny.path, dtype="float32", max_num_batched_tokens=32,
              enable_prefix_caching=True)
    # A plain request caches PROMPT's two full blocks, and a plain repeat hits them...
    llm.generate([PROMPT], _params(None))
    assert llm.generate([PROMPT], _params(None))[0].num_cached_tokens == 32
    # ...but one asking for prompt logprobs would then have none for those positions: no hit.
    out = llm.generate([PROMPT], _params())[0]
    assert out.num_cached_tokens == 0
    _check(out.prompt_logprobs, PROMPT, reference)
    # Sharing a prefix in the same batch: the asker is complete, the plain one may hit.
    other = PROMPT[:32] + _prompt(10, salt=9)
    plain, asking = llm.generate([other, other], [_params(None), _params()])
    assert plain.num_cached_tokens == 32 and asking.num_cached_tokens == 0
    _check(asking.prompt_logprobs, other, _reference(tiny, other))
    assert plain.prompt_logprobs is None
    # An asking request still writes its blocks to the cache: a later plain one hits them.
    fresh = _prompt(40, salt=11)
    llm.generate([fresh], _params())
    assert llm.generate([fresh + [5, 6]], _params(None))[0].num_cached_tokens == 32


@pytest.mark.parametrize("lengths,budget,when", [
    ([90, 90, 90, 90], 64, "mid-prompt"),
    ([31, 31, 31, 31, 47, 15, 60], 32, "after-first-token"),
])
def test_preemption_by_recompute_keeps_them_complete(tiny, lengths, budget, when):
    """Requests asking for prompt logprobs are preempted by recompute, mid-prompt (their
    positions are computed again and overwrite) or after their first token (nothing is
    recorded again); the entries are those of each prompt alone."""
    prompts = [_prompt(n, salt=i) for i, n in enumerate(lengths)]
    refs = [_reference(tiny, p) for p in prompts]
    # 16 blocks of 16 cannot hold them all: vllm-v1 order preempts prefills as well.
    llm = LLM(loaded=tiny, model=tiny.path, dtype="float32", max_num_batched_tokens=budget,
              scheduler="vllm-v1", num_kv_blocks=16, preemption_mode="recompute",
              max_model_len=128)
    engine = llm.engine
    runner, scheduler = engine.executor, engine.scheduler
    recorded: dict[str, list[int]] = {}
    preempted_with_outputs: dict[str, int] = {}  # request id -> outputs when last preempted
    run_chunks, schedule = runner._prompt_logprobs, scheduler.schedule

    def spy_chunks(out, layout, hidden):  # type: ignore[no-untyped-def]
        result = run_chunks(out, layout, hidden)
        for rid, (first, entries) in result.items():
            recorded.setdefault(rid, []).extend(range(first, first + len(entries)))
        return result

    def spy_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        for rid in out.preempted_req_ids:
            preempted_with_outputs[rid] = len(scheduler.requests[rid].output_token_ids)
        return out

    runner._prompt_logprobs = spy_chunks
    scheduler.schedule = spy_schedule
    ids = [engine.add_request(None, p, _params(K, n=12)) for p in prompts]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            outs[out.request_id] = out
    counts = list(preempted_with_outputs.values())
    if when == "mid-prompt":
        assert any(n == 0 for n in counts), preempted_with_outputs
    else:
        assert any(n > 0 for n in counts), preempted_with_outputs
    repeated = 0
    for rid, prompt, ref in zip(ids, prompts, refs):
        _check(outs[rid].prompt_logprobs, prompt, ref)
        assert sorted(set(recorded[rid])) == list(range(1, len(prompt)))
        repeated += len(recorded[rid]) - len(prompt) + 1
    # A mid-prompt recompute overwrites entries; one after the first token records none.
    assert (repeated > 0) == (when == "mid-prompt")
    assert scheduler.kv.stats().num_used_blocks == 0


def test_validation():
    with pytest.raises(ValueError, match="^prompt_logprobs must"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="^prompt_logprobs must"):
        SamplingParams(prompt_logprobs=1.5)  # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams().prompt_logprobs is None
