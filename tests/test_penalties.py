"""Penalties and logit_bias (vLLM's definitions) against a plain-Python reference.

The reference applies, per token id: logit_bias added; repetition_penalty over every id in the
prompt or the output (a positive logit divided by it, any other multiplied); then
frequency_penalty * count and presence_penalty * (count > 0) subtracted, counting the output.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.engine.processor import Processor
from chunkserve.engine.sampler import Sampler, SamplerOutput, SamplingRow, process_logits
from chunkserve.model.factory import LoadedModel, load_model

VOCAB = 50


# --- the reference -------------------------------------------------------------------------

def reference_logits(
    logits: Sequence[float], params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> list[float]:
    """vLLM's logit_bias then apply_penalties, one token id at a time."""
    out = [float(x) for x in logits]
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    rp = params.repetition_penalty
    for token in range(len(out)):
        if token in prompt or token in output:
            out[token] = out[token] / rp if out[token] > 0 else out[token] * rp
    for token in range(len(out)):
        count = sum(1 for t in output if t == token)
        out[token] -= params.frequency_penalty * count
        out[token] -= params.presence_penalty * (1 if count > 0 else 0)
    return out


def argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


# --- sampler unit tests --------------------------------------------------------------------

def make_row(params: SamplingParams, prompt: list[int], output: list[int]) -> SamplingRow:
    return SamplingRow(params=params, generator=None, num_output_tokens=len(output),
                       eos_token_ids=[], prompt_token_ids=prompt, output_token_ids=output)


def token_lists(seed: int) -> tuple[list[int], list[int]]:
    """A prompt and an output with repeats, overlapping each other and the top logits."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    output = torch.randint(0, VOCAB // 2, (9,), generator=g).tolist()
    return prompt, output + output[:3]


def random_logits(n: int, seed: int) -> torch.Tensor:
    # Mixed signs, so repetition_penalty's two branches both run.
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


UNIT_CASES: dict[str, dict[str, object]] = {
    "repetition>1": dict(repetition_penalty=1.8),
    "repetition<1": dict(repetition_penalty=0.6),
    "frequency": dict(frequency_penalty=1.5),
    "frequency<0": dict(frequency_penalty=-1.0),
    "presence": dict(presence_penalty=2.0),
    "presence<0": dict(presence_penalty=-0.7),
    "logit_bias": dict(logit_bias={3: 4.0, 7: -2.5, 11: 100.0}),
    "combined": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.9,
                     logit_bias={0: 1.5, 5: -3.0}),
}


@pytest.mark.parametrize("case", list(UNIT_CASES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_matches_reference(case: str, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, **UNIT_CASES[case])  # type: ignore[arg-type]
    logits = random_logits(6, seed=1)
    before = logits.clone()
    rows = [make_row(params, *token_lists(seed)) for seed in range(6)]
    processed = process_logits(logits, rows)
    for i, row in enumerate(rows):
        expected = reference_logits(logits[i].tolist(), params, row.prompt_token_ids,
                                    row.output_token_ids)
        assert torch.allclose(processed[i], torch.tensor(expected), rtol=1e-6, atol=1e-5), case
    assert torch.equal(logits, before), "the caller's logits were modified"
    assert not torch.equal(processed, logits), "the case must change something"
    if temperature == 0.0:
        out = Sampler()(logits, rows)
        assert out.token_ids == [argmax(p.tolist()) for p in processed]


def test_mixed_batch_rows_without_penalties_are_untouched() -> None:
    logits = random_logits(6, seed=2)
    prompt, output = token_lists(3)
    plain_greedy = SamplingParams(temperature=0.0)
    rows = [
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
                 prompt, output),
        make_row(plain_greedy, prompt, output),
        make_row(SamplingParams(temperature=0.7, presence_penalty=1.5), prompt, output),
        make_row(SamplingParams(temperature=0.7), prompt, output),
        make_row(SamplingParams(temperature=0.0, logit_bias={4: 9.0}), prompt, output),
        make_row(plain_greedy, prompt, output),
    ]
    processed = process_logits(logits, rows)
    for i in (1, 3, 5):
        assert torch.equal(processed[i], logits[i])
    for i in (0, 2, 4):
        expected = reference_logits(logits[i].tolist(), rows[i].params, prompt, output)
        assert torch.allclose(processed[i], torch.tensor(expected), rtol=1e-6, atol=1e-5)
    out = Sampler()(logits, rows)
    for i in (0, 1, 4, 5):
        assert out.token_ids[i] == argmax(processed[i].tolist())


def test_batch_without_penalties_is_not_copied() -> None:
    logits = random_logits(3, seed=4)
    prompt, output = token_lists(5)
    rows = [make_row(SamplingParams(temperature=t), prompt, output) for t in (0.0, 1.0, 0.5)]
    assert process_logits(logits, rows) is logits


def test_all_rows_penalised_and_min_tokens_mask_stay_finite_or_minus_inf() -> None:
    """The -inf of the min_tokens mask stays -inf under every penalty (no NaN)."""
    logits = random_logits(2, seed=6)
    before = logits.clone()
    eos = 2
    params = SamplingParams(temperature=0.0, min_tokens=5, repetition_penalty=1.7,
                            frequency_penalty=-2.0, presence_penalty=2.0, logit_bias={eos: 50.0})
    rows = [SamplingRow(params, None, 1, [eos], [eos, 3, 3], [eos]) for _ in range(2)]
    processed = process_logits(logits, rows)
    assert torch.isneginf(processed[:, eos]).all()
    assert not processed.isnan().any()
    assert torch.equal(logits, before)
    assert eos not in Sampler()(logits, rows).token_ids


def test_logit_bias_steers_random_rows_and_logprobs_stay_raw() -> None:
    logits = random_logits(1, seed=7)
    params = SamplingParams(temperature=1.0, logit_bias={13: 100.0}, logprobs=2,
                            repetition_penalty=2.0)
    row = SamplingRow(params, torch.Generator().manual_seed(0), 0, [], [13], [])
    sampler = Sampler()
    outs = [sampler(logits, [row]) for _ in range(20)]
    assert {o.token_ids[0] for o in outs} == {13}
    raw = logits[0].log_softmax(dim=-1)
    assert outs[0].logprobs is not None
    assert outs[0].logprobs[0][0] == (13, pytest.approx(float(raw[13]), abs=1e-5))


def test_ids_outside_the_logits_are_ignored_not_fatal() -> None:
    """An engine without a vocabulary check (placeholder tokens) must not fail the step."""
    logits = random_logits(1, seed=8)
    params = SamplingParams(temperature=0.0, logit_bias={VOCAB + 3: 5.0},
                            repetition_penalty=2.0, frequency_penalty=1.0)
    row = make_row(params, [VOCAB + 10, 1], [VOCAB + 1, 2])
    processed = process_logits(logits, [row])
    expected = reference_logits(logits[0].tolist(), SamplingParams(
        repetition_penalty=2.0, frequency_penalty=1.0), [1], [2])
    assert torch.allclose(processed[0], torch.tensor(expected), rtol=1e-6, atol=1e-5)


# --- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0."),
        (dict(presence_penalty=-2.5), "presence_penalty must be in [-2, 2]"),
        (dict(presence_penalty=math.nan), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=2.01), "frequency_penalty must be in [-2, 2]"),
        (dict(frequency_penalty="1"), "frequency_penalty must be in [-2, 2]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=math.inf), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=math.nan), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=1e-320), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=0.0099), "repetition_penalty must be in [0.01, 100]"),
        (dict(repetition_penalty=100.01), "repetition_penalty must be in [0.01, 100]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={"abc": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={True: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={5: math.inf}), "logit_bias values must be finite numbers"),
        (dict(logit_bias={5: math.nan}), "logit_bias values must be finite numbers"),
        (dict(logit_bias={5: "x"}), "logit_bias values must be finite numbers"),
        (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert str(e.value).startswith(message)
    assert str(e.value).split(" ", 1)[0] == next(iter(kwargs))  # the server's 400 `param`


def test_defaults_and_clamping() -> None:
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (
        0.0, 0.0, 1.0, None)
    assert not p.has_penalties
    for edge in (dict(presence_penalty=-2), dict(frequency_penalty=2.0),
                 dict(repetition_penalty=0.01), dict(repetition_penalty=100)):
        assert SamplingParams(**edge).has_penalties  # type: ignore[arg-type]
    # vLLM's OpenAI layer clamps to [-100, 100]; JSON object keys arrive as strings.
    p = SamplingParams(logit_bias={5: 500.0, "7": -1e9, 9: 3})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 3.0}
    assert all(type(v) is float for v in p.logit_bias.values())


def test_processor_refuses_out_of_vocab_logit_bias() -> None:
    processor = Processor(max_model_len=64, vocab_size=100)
    ok = processor.process_inputs("a", [1, 2, 3], SamplingParams(logit_bias={0: 1.0, 99: -1.0}))
    assert ok.sampling_params.logit_bias == {0: 1.0, 99: -1.0}
    with pytest.raises(ValueError) as e:
        processor.process_inputs("b", [1, 2, 3], SamplingParams(logit_bias={5: 1.0, 100: 2.0}))
    assert str(e.value) == ("logit_bias is invalid: token_id(s) [100] in logit_bias contain "
                            "out-of-vocab token ids. Vocabulary size: 100")
    # Without a vocabulary (the simulator's placeholder tokens) nothing is checked.
    Processor(max_model_len=64, vocab_size=None).process_inputs(
        "c", [1, 2], SamplingParams(logit_bias={10**6: 1.0}))


# --- end to end ----------------------------------------------------------------------------

# Two alternating tokens: the tiny random model then repeats itself within a few tokens, so
# each penalty visibly changes greedy output.
PROMPT = [200, 300] * 20
NUM_TOKENS = 10
BUDGETS = (16, 32, 128)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> LoadedModel:
    return load_model(tiny_model_dir, "float32", max_model_len=256)


class RecordingSampler:
    """Wraps the runner's sampler, keeping the raw logits of each call."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        self.logits.append(logits.detach().cpu().clone())
        return self.inner(logits, rows)


@pytest.fixture(scope="module")
def raw_next(tiny: LoadedModel) -> Callable[[list[int]], list[float]]:
    """Raw next-token logits after `ids`, from an engine run without any penalty."""
    llm = LLM(loaded=tiny, model=tiny.path)
    recorder = RecordingSampler(llm.engine.executor.sampler)
    llm.engine.executor.sampler = recorder
    plain = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(ids: list[int]) -> list[float]:
        recorder.logits.clear()
        llm.generate([ids], plain)
        assert len(recorder.logits) == 1
        return recorder.logits[0][0].tolist()

    return run


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                          **kw)  # type: ignore[arg-type]


def reference_greedy(
    raw_next: Callable[[list[int]], list[float]], params: SamplingParams
) -> list[int]:
    """Greedy decoding where each step's raw logits come from a plain engine run over the
    prompt and the output so far, and the penalties from `reference_logits`."""
    output: list[int] = []
    for _ in range(NUM_TOKENS):
        logits = reference_logits(raw_next(PROMPT + output), params, PROMPT, output)
        output.append(argmax(logits))
    return output


@pytest.fixture(scope="module")
def unpenalised(tiny: LoadedModel) -> list[int]:
    llm = LLM(loaded=tiny, model=tiny.path)
    return llm.generate([PROMPT], greedy())[0].outputs[0].token_ids


def e2e_params(case: str, unpenalised: list[int]) -> SamplingParams:
    most_common = max(set(unpenalised), key=unpenalised.count)
    return {
        "repetition": greedy(repetition_penalty=2.0),
        "frequency": greedy(frequency_penalty=2.0),
        "presence": greedy(presence_penalty=2.0),
        # Bans the unpenalised run's favourite token and lifts another.
        "logit_bias": greedy(logit_bias={most_common: -100.0, 1000: 5.0}),
        "combined": greedy(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                           logit_bias={most_common: -3.0}),
    }[case]


E2E_CASES = ["repetition", "frequency", "presence", "logit_bias", "combined"]


@pytest.fixture(scope="module")
def chunked(tiny: LoadedModel) -> dict[int, LLM]:
    """One engine per chunk budget: the 40-token prompt takes 3, 2 and 1 prefill steps."""
    return {b: LLM(loaded=tiny, model=tiny.path, max_num_batched_tokens=b,
                   enable_chunked_prefill=True) for b in BUDGETS}


@pytest.mark.parametrize("case", E2E_CASES)
def test_greedy_generation_matches_reference_at_every_chunk_budget(
    case: str, chunked: dict[int, LLM], raw_next: Callable[[list[int]], list[float]],
    unpenalised: list[int],
) -> None:
    assert unpenalised.count(max(set(unpenalised), key=unpenalised.count)) >= 2, (
        "the unpenalised output must repeat a token for the penalties to bite")
    params = e2e_params(case, unpenalised)
    expected = reference_greedy(raw_next, params)
    assert expected != unpenalised, f"{case}: the field must change greedy output"
    for budget, llm in chunked.items():
        got = llm.generate([PROMPT], params)[0].outputs[0].token_ids
        assert got == expected, f"{case}, max_num_batched_tokens={budget}"


def test_penalised_and_plain_requests_share_a_batch(
    chunked: dict[int, LLM], unpenalised: list[int]
) -> None:
    """One batch mixing penalised and plain requests: each gets what it gets alone (the
    alone results of the penalised cases are checked against the reference above)."""
    llm = chunked[32]
    cases = ["combined", "repetition", "logit_bias"]
    params = [greedy()] + [e2e_params(c, unpenalised) for c in cases] + [greedy()]
    together = llm.generate([PROMPT] * len(params), params)
    alone = [unpenalised] + [llm.generate([PROMPT], p)[0].outputs[0].token_ids
                             for p in params[1:-1]] + [unpenalised]
    assert [o.outputs[0].token_ids for o in together] == alone


def test_engine_refuses_out_of_vocab_logit_bias(tiny: LoadedModel) -> None:
    llm = LLM(loaded=tiny, model=tiny.path)
    vocab = llm.engine.processor.vocab_size
    assert vocab is not None
    with pytest.raises(ValueError, match=r"^logit_bias is invalid: token_id\(s\) \[\d+\] in "
                                         r"logit_bias contain out-of-vocab token ids"):
        llm.engine.add_request(None, PROMPT, greedy(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished_requests()
