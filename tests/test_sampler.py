"""Sampler: greedy, support restrictions, seeding, min_tokens and logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve.engine.sampler import DRAW_BLOCK, Sampler, SamplerOutput, SamplingRow, inverse_cdf
from chunkserve.sampling_params import SamplingParams

VOCAB = 50


def row(seed_gen: int | None = None, n_out: int = 0, eos: list[int] | None = None, **kw: object) -> SamplingRow:
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed_gen) if seed_gen is not None else None
    return SamplingRow(params=params, generator=gen, num_output_tokens=n_out, eos_token_ids=eos or [])


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draws(logits: torch.Tensor, n: int, **kw: object) -> set[int]:
    """Tokens seen over n single-row draws of the first logits row."""
    sampler = Sampler()
    r = row(seed_gen=123, **kw)
    return {sampler(logits[:1], [r]).token_ids[0] for _ in range(n)}


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    out = Sampler()(logits, [row(temperature=0.0, top_k=3, top_p=0.1) for _ in range(8)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = random_logits(6)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(6)]
    out = Sampler()(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_caller_logits_untouched() -> None:
    logits = random_logits(2)
    before = logits.clone()
    Sampler()(logits, [row(min_tokens=3, eos=[0], temperature=0.7, top_k=5, min_p=0.1)] * 2)
    assert torch.equal(logits, before)


def test_top_k_restricts_support() -> None:
    logits = torch.zeros(1, VOCAB)  # flat: without top-k every token is likely
    logits[0, 7], logits[0, 3] = 0.5, 0.4
    assert draws(logits, 300, top_k=2) == {7, 3}


def test_top_p_small_is_argmax() -> None:
    logits = random_logits(1, seed=1)
    assert draws(logits, 100, top_p=1e-6) == {int(logits.argmax())}


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    # probs 0.5, 0.3, 0.2: top_p=0.7 needs the first two (0.5 < 0.7 <= 0.8).
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    assert draws(logits, 300, top_p=0.7) == {0, 1}
    assert draws(logits, 300, top_p=0.5) == {0}
    assert draws(logits, 500, top_p=0.81) == {0, 1, 2}


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # threshold = 0.4 * 0.4 = 0.16: token 3 (0.1) goes, token 2 (0.2) stays.
    assert draws(logits, 400, min_p=0.4) == {0, 1, 2}
    # threshold = 0.6 * 0.4 = 0.24: only 0.4 and 0.3 remain.
    assert draws(logits, 400, min_p=0.6) == {0, 1}


def test_temperature_sharpens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    # At T=0.01 token 5 beats every other token by e^100.
    assert draws(logits, 100, temperature=0.01) == {5}
    assert len(draws(logits, 200, temperature=1.0)) > 10


def test_seeded_rows_reproducible_and_batch_independent() -> None:
    sampler = Sampler()
    steps = [random_logits(4, seed=s) for s in range(20)]

    def run(batch_size: int, target: int) -> list[int]:
        rows = [row(seed_gen=1000 + i, temperature=1.0, top_k=20) for i in range(batch_size)]
        rows[target] = row(seed_gen=42, temperature=0.9, top_p=0.9)
        tokens = []
        for step in steps:
            # The seeded request always sees step[0]; its neighbours vary.
            logits = step[:batch_size].clone()
            logits[target] = step[0]
            tokens.append(sampler(logits, rows).token_ids[target])
        return tokens

    alone = run(1, 0)
    assert run(1, 0) == alone
    assert run(4, 2) == alone
    assert run(3, 1) == alone
    assert len(set(alone)) > 1  # actually random, not collapsed to argmax


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 9] = 10.0, 9.0, 8.0  # eos, stop id, normal
    sampler = Sampler()
    early = row(temperature=0.0, min_tokens=2, n_out=1, eos=[1], stop_token_ids=[2])
    assert sampler(logits, [early]).token_ids == [9]
    done = row(temperature=0.0, min_tokens=2, n_out=2, eos=[1], stop_token_ids=[2])
    assert sampler(logits, [done]).token_ids == [1]
    # ignore_eos: EOS never stops the request, so only the stop ids are masked.
    ignore = row(temperature=0.0, min_tokens=2, n_out=0, eos=[1], stop_token_ids=[2], ignore_eos=True)
    assert sampler(logits, [ignore]).token_ids == [1]
    sampled = row(seed_gen=0, temperature=1.0, min_tokens=5, eos=[1], stop_token_ids=[2])
    assert all(sampler(logits, [sampled]).token_ids[0] not in (1, 2) for _ in range(50))


def test_logprobs_match_log_softmax() -> None:
    logits = random_logits(3, seed=5)
    rows = [row(temperature=0.0, logprobs=3), row(temperature=0.0), row(seed_gen=1, logprobs=0)]
    out = Sampler()(logits, rows)
    ref = logits.log_softmax(dim=-1)
    assert out.logprobs is not None
    first = out.logprobs[0]
    assert first[0][0] == out.token_ids[0]
    top = ref[0].topk(3)
    assert [t for t, _ in first[1:]] == top.indices.tolist()
    for (tok, lp) in first:
        assert math.isclose(lp, float(ref[0, tok]), rel_tol=1e-5, abs_tol=1e-6)
    assert out.logprobs[1] == []
    sampled = out.logprobs[2]
    assert len(sampled) == 1 and sampled[0][0] == out.token_ids[2]
    assert math.isclose(sampled[0][1], float(ref[2, out.token_ids[2]]), abs_tol=1e-6)


def test_logprobs_are_raw_before_min_tokens_mask() -> None:
    logits = random_logits(1, seed=2)
    eos = int(logits.argmax())
    out = Sampler()(logits, [row(temperature=0.0, min_tokens=1, eos=[eos], logprobs=1)])
    assert out.logprobs is not None
    assert out.token_ids[0] != eos
    assert out.logprobs[0][1][0] == eos  # the top raw logprob is still reported


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(random_logits(2), [row()])


@pytest.mark.parametrize("vocab", [3 * DRAW_BLOCK, 3 * DRAW_BLOCK + 17])
def test_inverse_cdf_draws_each_token_with_its_probability(vocab: int) -> None:
    """Many draws of one row whose support sits at block edges, in the first and last block
    and in the padded one: frequencies within 5 standard errors of the probabilities, and no
    token of probability 0 ever drawn (a whole block of them included)."""
    support = torch.tensor([0, 1, 500, DRAW_BLOCK - 1, 2 * DRAW_BLOCK, 2 * DRAW_BLOCK + 1,
                            3 * DRAW_BLOCK - 1, vocab - 1])
    p = torch.zeros(vocab)
    p[support] = torch.arange(1, len(support) + 1, dtype=torch.float32)
    p /= p.sum()
    g = torch.Generator().manual_seed(vocab)
    n, batch = 40_000, 4_000
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(n // batch):
        u = torch.rand(batch, dtype=torch.float64, generator=g)
        counts += torch.bincount(inverse_cdf(p.expand(batch, vocab), u)[0], minlength=vocab)
    freq, q = counts / n, p.double()
    assert freq.shape == (vocab,)
    assert float(freq[q == 0].sum()) == 0.0
    stderr = torch.sqrt(q[support] * (1 - q[support]) / n)
    assert float(((freq[support] - q[support]).abs() / stderr).max()) < 5


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(1, 3 * DRAW_BLOCK),
       u=st.lists(st.one_of(st.just(0.0), st.just(1.0 - 2 ** -53), st.floats(0, 1, exclude_max=True)),
                  min_size=1, max_size=4))
def test_inverse_cdf_never_draws_a_token_of_probability_zero(seed: int, vocab: int,
                                                             u: list[float]) -> None:
    """Whatever the uniform number, at its ends too: a token of the row's support, in range."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(len(u), vocab, generator=g)
    p = p * (torch.rand(len(u), vocab, generator=g) < 0.3)  # most tokens cut (a top-k/top-p)
    p[:, torch.randint(vocab, (1,), generator=g)] = 1e-30  # and a tiny one kept
    tokens, _ = inverse_cdf(p / p.sum(-1, keepdim=True), torch.tensor(u, dtype=torch.float64))
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    assert bool((p[torch.arange(len(u)), tokens] > 0).all())
