"""Benchmark workloads: arrival processes, and prompts of exact token length for SmolLM2."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from chunkserve.benchlib.workloads import BenchRequest, arrival_times, sample_requests


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str):  # type: ignore[no-untyped-def]
    from chunkserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


def _gaps(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    return np.diff(arrival_times(num, rate, burstiness, seed))


# ---- arrivals ----------------------------------------------------------------------------------

def test_poisson_mean_rate() -> None:
    times = arrival_times(2000, 4.0, 1.0, seed=0)
    assert len(times) == 2000 and times[0] == 0.0
    gaps = np.diff(times)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    # Exponential gaps: standard deviation equals the mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_burstiness_sets_coefficient_of_variation(burstiness: float) -> None:
    gaps = _gaps(4000, 4.0, burstiness, seed=0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # the rate does not depend on it
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_burstiness_orders_variance() -> None:
    var = {b: _gaps(4000, 4.0, b, seed=1).var() for b in (0.5, 1.0, 2.0)}
    assert var[0.5] > var[1.0] > var[2.0]


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_arrivals_are_seeded() -> None:
    assert arrival_times(50, 3.0, 0.7, seed=3) == arrival_times(50, 3.0, 0.7, seed=3)
    assert arrival_times(50, 3.0, 0.7, seed=3) != arrival_times(50, 3.0, 0.7, seed=4)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_arrivals_reject_bad_parameters(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(3, rate, burstiness, seed=0)


# ---- prompts -----------------------------------------------------------------------------------

def _assert_exact(tokenizer, requests: list[BenchRequest]) -> None:  # type: ignore[no-untyped-def]
    special = set(tokenizer.all_special_ids)
    for r in requests:
        ids = tokenizer.encode(r.prompt, add_special_tokens=False)
        assert ids == r.prompt_token_ids and len(ids) == r.prompt_len, r
        assert not special & set(ids)
        assert r.output_len >= 1


def test_random_lengths_are_exact(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = sample_requests("random", tokenizer, 40, seed=0, random_input_len=64,
                           random_output_len=20, random_range_ratio=0.5)
    _assert_exact(tokenizer, reqs)
    # vLLM's range: uniform in [floor(L(1-r)), ceil(L(1+r))].
    assert all(32 <= r.prompt_len <= 96 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10


def test_random_fixed_length(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = sample_requests("random", tokenizer, 20, seed=5, random_input_len=1,
                           random_output_len=7)
    _assert_exact(tokenizer, reqs)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(1, 7)}
    assert len({r.prompt for r in reqs}) > 1  # the offset varies the text


def test_mixed_lengths_and_long_share(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = sample_requests("mixed", tokenizer, 50, seed=0, long_fraction=0.2,
                           long_input_range=(300, 400), short_input_range=(8, 32),
                           output_range=(4, 16))
    _assert_exact(tokenizer, reqs)
    long = [r for r in reqs if r.prompt_len >= 300]
    assert len(long) == 10
    assert all(r.prompt_len <= 400 for r in long)
    assert all(8 <= r.prompt_len <= 32 for r in reqs if r not in long)
    assert all(4 <= r.output_len <= 16 for r in reqs)
    # Long prompts are spread through the run, not bunched at the start.
    positions = [i for i, r in enumerate(reqs) if r.prompt_len >= 300]
    assert positions != list(range(10))


def test_mixed_defaults_are_the_articles(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = sample_requests("mixed", tokenizer, 20, seed=1)
    _assert_exact(tokenizer, reqs)
    assert sum(r.prompt_len >= 2048 for r in reqs) == 2  # 10% of 20, 2048..4096 tokens
    assert all(r.prompt_len <= 4096 for r in reqs)
    assert all(32 <= r.prompt_len <= 256 for r in reqs if r.prompt_len < 2048)
    assert all(32 <= r.output_len <= 128 for r in reqs)


def test_sharegpt_like_lengths(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = sample_requests("sharegpt-like", tokenizer, 30, seed=0)
    _assert_exact(tokenizer, reqs)
    assert all(4 <= r.prompt_len <= 1024 and 1 <= r.output_len <= 1024 for r in reqs)
    assert all(r.prompt_len + r.output_len <= 2048 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # a spread, not one length


def test_sharegpt_like_distribution_shape(tokenizer) -> None:  # type: ignore[no-untyped-def]
    lens = np.array([r.prompt_len for r in sample_requests("sharegpt-like", tokenizer, 300, 2)])
    assert np.median(lens) < lens.mean()  # right-skewed like ShareGPT
    assert 60 <= np.median(lens) <= 180


@pytest.mark.parametrize("name", ["random", "mixed", "sharegpt-like"])
def test_same_seed_same_requests(tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(random_input_len=24, random_output_len=8, random_range_ratio=0.5,
                  long_input_range=(100, 120), short_input_range=(8, 16))
    a = sample_requests(name, tokenizer, 12, seed=7, **kwargs)  # type: ignore[arg-type]
    b = sample_requests(name, tokenizer, 12, seed=7, **kwargs)  # type: ignore[arg-type]
    c = sample_requests(name, tokenizer, 12, seed=8, **kwargs)  # type: ignore[arg-type]
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_file_dataset(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Hello there, how are you?", "output_len": 5}, {"prompt": "One two three"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = sample_requests("file", tokenizer, 2, seed=0, random_output_len=9,
                           dataset_path=str(path))
    assert [r.prompt for r in reqs] == [row["prompt"] for row in rows]
    assert [r.output_len for r in reqs] == [5, 9]  # missing output_len: --random-output-len
    _assert_exact(tokenizer, reqs)
    # More prompts than lines: seeded repeats, still every request sent.
    more = sample_requests("file", tokenizer, 5, seed=0, random_output_len=9,
                           dataset_path=str(path))
    assert len(more) == 5 and more[:2] == reqs
    assert {r.prompt for r in more} <= {row["prompt"] for row in rows}


def test_bad_dataset_arguments(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="unknown dataset"):
        sample_requests("sonnet", tokenizer, 2, seed=0)
    with pytest.raises(ValueError, match="dataset-path"):
        sample_requests("file", tokenizer, 2, seed=0)
    with pytest.raises(ValueError, match="range_ratio"):
        sample_requests("random", tokenizer, 2, seed=0, random_range_ratio=1.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompt"):
        sample_requests("file", tokenizer, 1, seed=0, dataset_path=str(bad))
