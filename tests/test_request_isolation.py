"""One request can never fail another (issue 51): a failure of one request's own (its row of
the logits, its grammar, a sampling rule that raises, its detokenizer) ends that request alone
with finish_reason "error", and every other request of the step gets the tokens it gets alone.
A failed step fails only its own requests, and the engine checks its books before going on.

The sampler's guard is reached here by values the API's bounds refuse (a SamplingParams that
skips its checks), as an engine built without those bounds, or a bug, would send them."""
from __future__ import annotations

import math
import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.engine import sampler as sampler_module
from chunkserve.engine.llm_engine import LLMEngine, StepError
from chunkserve.engine.sampler import Sampler, SamplingRow
from chunkserve.model.factory import LoadedModel, load_model
from chunkserve.outputs import RequestOutput

PROMPTS = [[(7 * i + 3 * j) % 20000 + 300 for i in range(24)] for j in range(3)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> LoadedModel:
    return load_model(tiny_model_dir, "float32", max_model_len=256)


def greedy(n: int = 5, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


class _Unchecked(SamplingParams):
    def _verify(self) -> None:
        pass  # what an engine without the bounds would let through


def unchecked(params: SamplingParams, **fields: object) -> SamplingParams:
    """`params` with fields past SamplingParams' range checks (copies keep skipping them)."""
    kwargs = {f: getattr(params, f) for f in ("max_tokens", "temperature", "ignore_eos")}
    return _Unchecked(**kwargs, **fields)  # type: ignore[arg-type]


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
            ) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step().outputs
        except StepError as e:
            outputs = engine.fail_step(e)
        finals.update({o.request_id: o for o in outputs if o.finished})
    return finals


def make_engine(tiny: LoadedModel, **kw: object) -> LLMEngine:
    return LLMEngine.from_kwargs(loaded=tiny, model=tiny.path, max_num_batched_tokens=64,
                                 num_kv_blocks=64, **kw)


def alone(tiny: LoadedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    out = run_all(make_engine(tiny), {"a": (prompt, params)})["a"]
    return out.outputs[0].token_ids


def assert_clean(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    engine.scheduler.check_consistency()


# ---- the sampler --------------------------------------------------------------------------------

def row(params: SamplingParams, seed: int | None = None) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    # A prompt of 200 ids: a repetition penalty reaches positive logits among them.
    return SamplingRow(params, gen, 0, [0], list(range(200)), [])


def test_a_row_the_sampler_cannot_draw_from_fails_alone() -> None:
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))
    logits[3, 17] = math.nan  # the model's fault: a NaN in its own logits
    rows = [row(unchecked(SamplingParams(), repetition_penalty=1e-320)),  # -> inf logits
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.8), seed=5),
            row(SamplingParams(temperature=0.7))]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == -1 and out.token_ids[3] == -1
    assert out.failed[0].client_error and "no token could be sampled" in out.failed[0].message
    assert not out.failed[3].client_error and "not finite" in out.failed[3].message
    assert set(out.failed) == {0, 3}
    # The sound rows drew as they would alone: greedy the argmax, the seeded one its own draw.
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.token_ids[2] == Sampler()(logits[2:3], [row(rows[2].params, seed=5)]).token_ids[0]
    assert 0 <= out.token_ids[2] < 3000


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_inverse_cdf_never_indexes_past_the_vocabulary(value: float) -> None:
    probs = torch.full((2, 2500), value)
    probs[1] = 1.0 / 2500
    tokens, ok = sampler_module.inverse_cdf(probs, torch.tensor([0.5, 0.999], dtype=torch.float64))
    assert ok.tolist() == [False, True]
    assert all(0 <= t < 2500 for t in tokens.tolist())


def test_a_sampling_rule_that_raises_fails_only_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sampler_module._apply_logit_bias

    def exploding(logits, rows, owned):  # type: ignore[no-untyped-def]
        if any(r.params.logit_bias == {7: 1.0} for r in rows):
            raise RuntimeError("logits processor exploded")
        return real(logits, rows, owned)

    monkeypatch.setattr(sampler_module, "_apply_logit_bias", exploding)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    rows = [row(SamplingParams(temperature=0.9), seed=11), row(SamplingParams(logit_bias={7: 1.0})),
            row(SamplingParams(temperature=0.0, logprobs=2))]
    out = Sampler()(logits, rows)
    assert set(out.failed) == {1} and "exploded" in out.failed[1].message
    assert not out.failed[1].client_error
    # The retry drew the seeded row with the same uniform number: the same token as alone.
    assert out.token_ids[0] == Sampler()(logits[:1], [row(rows[0].params, seed=11)]).token_ids[0]
    assert out.token_ids[2] == int(logits[2].argmax())
    assert out.logprobs is not None and out.logprobs[1] == [] and len(out.logprobs[2]) == 3


# ---- the engine ---------------------------------------------------------------------------------

def test_a_bad_row_ends_its_request_alone_and_the_others_match_their_solo_tokens(
        tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    bad = unchecked(greedy(5), repetition_penalty=1e-320)
    finals = run_all(engine, {"good0": (PROMPTS[0], greedy()), "bad": (PROMPTS[1], bad),
                              "good2": (PROMPTS[2], greedy())})
    failed = finals["bad"]
    assert failed.outputs[0].finish_reason == "error" and failed.error is not None
    assert failed.error.client_error and failed.error.message.startswith("request bad: ")
    for rid, prompt in (("good0", PROMPTS[0]), ("good2", PROMPTS[2])):
        assert finals[rid].error is None
        assert finals[rid].outputs[0].token_ids == alone(tiny, prompt, greedy())
    assert_clean(engine)


def test_a_detokenizer_that_raises_fails_only_its_request(tiny: LoadedModel,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny)
    engine.add_request("victim", PROMPTS[0], greedy())
    state = engine._states["victim"]
    assert state.detokenizer is not None

    def broken(_ids: list[int]) -> str | None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(state.detokenizer, "update", broken)
    finals = run_all(engine, {"other": (PROMPTS[1], greedy())})
    finals.update(run_all(engine, {}))
    victim = [o for o in finals.values() if o.request_id == "victim"]
    assert victim and victim[0].outputs[0].finish_reason == "error"
    assert victim[0].error is not None and not victim[0].error.client_error
    assert "UnicodeDecodeError" in victim[0].error.message
    assert finals["other"].outputs[0].token_ids == alone(tiny, PROMPTS[1], greedy())
    assert_clean(engine)


def test_a_grammar_with_no_token_left_fails_alone_with_a_client_error(
        tiny: LoadedModel) -> None:
    """A choice whose only first token is a stop token that min_tokens forbids: the grammar's
    mask and the min_tokens mask leave no token to sample. That request's own input did it."""
    engine = make_engine(tiny)
    (x,) = engine.tokenizer.encode("x", add_special_tokens=False)
    from chunkserve.sampling_params import StructuredOutputsParams

    stuck = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2, stop_token_ids=[x],
                           structured_outputs=StructuredOutputsParams(choice=["x"]))
    finals = run_all(engine, {"stuck": (PROMPTS[0], stuck), "ok": (PROMPTS[1], greedy())})
    assert finals["stuck"].outputs[0].finish_reason == "error"
    assert finals["stuck"].error is not None and finals["stuck"].error.client_error
    assert finals["ok"].outputs[0].token_ids == alone(tiny, PROMPTS[1], greedy())
    assert_clean(engine)


def test_a_grammar_that_cannot_fill_its_mask_fails_alone(tiny: LoadedModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkserve.engine import grammar
    from chunkserve.sampling_params import StructuredOutputsParams

    real = grammar.lgnp.fill_next_token_bitmask

    def fill(matcher, mask, i):  # type: ignore[no-untyped-def]
        if i == 0:
            raise RuntimeError("matcher in a bad state")
        return real(matcher, mask, i)

    monkeypatch.setattr(grammar.lgnp, "fill_next_token_bitmask", fill)
    engine = make_engine(tiny)
    choice = SamplingParams(max_tokens=4, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    finals = run_all(engine, {"first": (PROMPTS[0], choice), "second": (PROMPTS[1], choice),
                              "plain": (PROMPTS[2], greedy())})
    assert finals["first"].outputs[0].finish_reason == "error"
    assert finals["first"].error is not None and "bad state" in finals["first"].error.message
    assert finals["second"].outputs[0].text in ("yes", "no")
    assert finals["plain"].outputs[0].token_ids == alone(tiny, PROMPTS[2], greedy())
    assert_clean(engine)


def test_a_failed_step_fails_its_requests_then_the_engine_goes_on(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tiny)
    real = engine.executor.execute
    calls = {"n": 0}

    def once_broken(out):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("kernel exploded")
        return real(out)

    monkeypatch.setattr(engine.executor, "execute", once_broken)
    engine.add_request("first", PROMPTS[0], greedy())
    with pytest.raises(StepError) as e:
        engine.step()
    outputs = engine.fail_step(e.value)
    assert [o.request_id for o in outputs] == ["first"]
    assert outputs[0].error is not None and "kernel exploded" in outputs[0].error.message
    finals = run_all(engine, {"later": (PROMPTS[1], greedy())})
    assert finals["later"].outputs[0].token_ids == alone(tiny, PROMPTS[1], greedy())
    assert_clean(engine)


def test_the_books_are_checked_after_a_failed_step(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request("r", PROMPTS[0], greedy())
    engine.step()
    engine.scheduler.check_consistency()
    table = engine.scheduler.kv.tables["r"][0]
    engine.scheduler.kv.pool.ref_cnt[table[0]] += 1  # a reference nobody holds
    with pytest.raises(RuntimeError, match="inconsistent"):
        engine.fail_step(StepError(["r"]))


def test_the_offline_llm_returns_the_others_when_one_fails(tiny: LoadedModel) -> None:
    llm = LLM(loaded=tiny, model=tiny.path, max_num_batched_tokens=64, num_kv_blocks=64)
    bad = unchecked(greedy(), repetition_penalty=1e-320)
    outs = llm.generate(PROMPTS, [greedy(), bad, greedy()])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error is not None and outs[1].error.client_error
    assert outs[0].outputs[0].token_ids == alone(tiny, PROMPTS[0], greedy())
    assert outs[2].outputs[0].token_ids == alone(tiny, PROMPTS[2], greedy())


def test_a_tensor_parallel_engine_fails_a_bad_row_alone(tiny_model_dir: str) -> None:
    """Rank 0 samples: a row it cannot sample fails there alone, and the ranks stay in step."""
    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", quantization="none",
                                   tensor_parallel_size=2, max_num_batched_tokens=32,
                                   num_kv_blocks=64)
    try:
        bad = unchecked(greedy(), repetition_penalty=1e-320)
        finals = run_all(engine, {"good": (PROMPTS[0], greedy()), "bad": (PROMPTS[1], bad)})
        assert finals["bad"].outputs[0].finish_reason == "error"
        solo = run_all(engine, {"solo": (PROMPTS[0], greedy())})["solo"]
        assert finals["good"].outputs[0].token_ids == solo.outputs[0].token_ids
        assert_clean(engine)
    finally:
        engine.close()
