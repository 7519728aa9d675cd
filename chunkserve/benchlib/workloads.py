"""Benchmark workloads: which prompts to send (with exact token lengths) and when to send them.

Every dataset draws from one `numpy.random.default_rng(seed)`, so a seed names a workload: two
runs with the same flags send byte-identical prompts, which is what makes sweeps comparable.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

DATASET_NAMES = ("random", "mixed", "sharegpt-like", "shared-prefix", "file", "json-schema")

# ShareGPT-like lengths (no download): log-normal fits of ShareGPT V3 as vLLM filters it (prompts
# and outputs of 4..1024 tokens, prompt + output <= 2048). Medians/sigmas give means near the
# dataset's ~200 prompt / ~200 output tokens with its long right tail.
_SHAREGPT_INPUT_MEDIAN, _SHAREGPT_INPUT_SIGMA = 110.0, 1.1
_SHAREGPT_OUTPUT_MEDIAN, _SHAREGPT_OUTPUT_SIGMA = 140.0, 0.9
_SHAREGPT_MIN_LEN, _SHAREGPT_MAX_LEN, _SHAREGPT_MAX_TOTAL = 4, 1024, 2048

# Decode/encode rarely needs more than 2-3 rounds to settle; the cap only guards against a
# tokenizer that never round-trips, which we report instead of looping forever.
_MAX_ROUNDS = 32


class BenchTokenizer(Protocol):
    """What the workloads need from a tokenizer (chunkserve's `Tokenizer` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def all_special_ids(self) -> list[int]: ...


@dataclass
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int]
    prompt_len: int
    output_len: int  # max_tokens; with a JSON schema a cap, the JSON's end stops it sooner
    # The JSON schema the output must follow (the json-schema dataset), else None.
    json_schema: dict[str, Any] | None = None


def _length_range(mean: int, ratio: float) -> tuple[int, int]:
    # vLLM's --random-range-ratio: uniform in [floor(L(1-r)), ceil(L(1+r))], never below 1 token.
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio}")
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def _uniform_ints(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = bounds
    if lo < 1 or hi < lo:
        raise ValueError(f"length range must satisfy 1 <= low <= high, got {bounds}")
    return rng.integers(lo, hi + 1, size=n)


class _TokenStream:
    """vLLM's synthetic token sequence `(offset + i + arange(n)) % vocab`, over non-special ids,
    readable past the first n so a prompt that re-encodes short can be topped up."""

    def __init__(self, allowed: np.ndarray, start: int) -> None:
        self._allowed = allowed
        self._pos = start

    def take(self, n: int) -> list[int]:
        idx = (self._pos + np.arange(n)) % len(self._allowed)
        self._pos += n
        return self._allowed[idx].tolist()


def _allowed_ids(tokenizer: BenchTokenizer) -> np.ndarray:
    # Special tokens (BOS/EOS/chat markers) would change the model's behaviour or be dropped by
    # decode(skip_special_tokens=True), so random prompts never contain them.
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), np.asarray(tokenizer.all_special_ids))
    if len(allowed) == 0:
        raise ValueError("the tokenizer has no non-special tokens")
    return allowed


def exact_length_prompt(tokenizer: BenchTokenizer, stream: _TokenStream,
                        target: int) -> tuple[str, list[int]]:
    """Text that encodes (without special tokens) to exactly `target` tokens.

    Decoding arbitrary ids and re-encoding merges or splits tokens at their seams, so we
    iterate: re-encode, cut the excess or append more tokens from the stream, until the text
    round-trips at the target length. The returned ids are `encode(text)` itself, so the length
    holds by construction for the tokenizer the server uses.
    """
    ids = stream.take(target)
    for _ in range(_MAX_ROUNDS):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            return text, encoded
        if len(encoded) > target:
            ids = encoded[:target]
        else:
            ids = encoded + stream.take(target - len(encoded))
    raise RuntimeError(f"could not build a prompt of exactly {target} tokens with this tokenizer")


def _synthetic(tokenizer: BenchTokenizer, rng: np.random.Generator, input_lens: np.ndarray,
               output_lens: np.ndarray) -> list[BenchRequest]:
    allowed = _allowed_ids(tokenizer)
    offsets = rng.integers(0, tokenizer.vocab_size, size=len(input_lens))
    requests = []
    for i, (n_in, n_out, offset) in enumerate(zip(input_lens, output_lens, offsets)):
        # `+ i` as in vLLM: two requests with the same offset still get different prompts.
        stream = _TokenStream(allowed, int(offset) + i)
        text, ids = exact_length_prompt(tokenizer, stream, int(n_in))
        requests.append(BenchRequest(text, ids, len(ids), int(n_out)))
    return requests


def _lognormal_lens(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    raw = np.rint(rng.lognormal(math.log(median), sigma, size=n)).astype(np.int64)
    return np.clip(raw, _SHAREGPT_MIN_LEN, _SHAREGPT_MAX_LEN)


def _from_file(path: str, tokenizer: BenchTokenizer, rng: np.random.Generator, num: int,
               default_output_len: int) -> list[BenchRequest]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string 'prompt'")
            rows.append((row["prompt"], int(row.get("output_len", default_output_len))))
    if not rows:
        raise ValueError(f"{path}: no requests")
    order = list(range(min(num, len(rows))))
    if num > len(rows):
        # Too few lines: repeat random ones (seeded) rather than silently sending fewer requests.
        order += rng.choice(len(rows), size=num - len(rows)).tolist()
    requests = []
    for k in order:
        prompt, out = rows[k]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        requests.append(BenchRequest(prompt, ids, len(ids), out))
    return requests


def sample_lengths(dataset_name: str, num_prompts: int, seed: int, *,
                   random_input_len: int = 1024, random_output_len: int = 128,
                   random_range_ratio: float = 0.0, long_fraction: float = 0.1,
                   long_input_range: tuple[int, int] = (2048, 4096),
                   short_input_range: tuple[int, int] = (32, 256),
                   output_range: tuple[int, int] = (32, 128),
                   ) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """(input lengths, output lengths, the generator after drawing them) of a synthetic dataset.

    The simulator needs only lengths; drawing them here, first, keeps a simulated workload
    identical to the real one for the same seed.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    if dataset_name == "random":
        input_lens = _uniform_ints(rng, _length_range(random_input_len, random_range_ratio),
                                   num_prompts)
        output_lens = _uniform_ints(rng, _length_range(random_output_len, random_range_ratio),
                                    num_prompts)
    elif dataset_name == "mixed":
        # The article's workload: a few long prompts whose prefills block many short requests.
        # An exact count of long prompts (at random positions) keeps the mix the same per seed.
        if not 0.0 <= long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
        is_long = np.zeros(num_prompts, dtype=bool)
        n_long = round(num_prompts * long_fraction)
        is_long[rng.choice(num_prompts, size=n_long, replace=False)] = True
        long_lens = _uniform_ints(rng, long_input_range, num_prompts)
        short_lens = _uniform_ints(rng, short_input_range, num_prompts)
        input_lens = np.where(is_long, long_lens, short_lens)
        output_lens = _uniform_ints(rng, output_range, num_prompts)
    elif dataset_name == "sharegpt-like":
        input_lens = _lognormal_lens(rng, _SHAREGPT_INPUT_MEDIAN, _SHAREGPT_INPUT_SIGMA,
                                     num_prompts)
        output_lens = _lognormal_lens(rng, _SHAREGPT_OUTPUT_MEDIAN, _SHAREGPT_OUTPUT_SIGMA,
                                      num_prompts)
        output_lens = np.minimum(output_lens, _SHAREGPT_MAX_TOTAL - input_lens)
    else:
        raise ValueError(f"dataset {dataset_name!r} has no synthetic lengths; expected one of "
                         "random, mixed, sharegpt-like")
    return input_lens, output_lens, rng


def sample_requests(dataset_name: str, tokenizer: BenchTokenizer, num_prompts: int, seed: int, *,
                    random_input_len: int = 1024, random_output_len: int = 128,
                    random_range_ratio: float = 0.0, long_fraction: float = 0.1,
                    long_input_range: tuple[int, int] = (2048, 4096),
                    short_input_range: tuple[int, int] = (32, 256),
                    output_range: tuple[int, int] = (32, 128),
                    dataset_path: str | None = None) -> list[BenchRequest]:
    """`num_prompts` requests of the named dataset; the same seed gives the same requests.

    prompt_len counts tokens without special tokens (vLLM's convention): a server whose
    tokenizer prepends BOS sees prompt_len + 1.
    """
    if dataset_name == "file":
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
        if not dataset_path:
            raise ValueError("the 'file' dataset needs --dataset-path (JSONL: prompt, output_len)")
        rng = np.random.default_rng(seed)
        return _from_file(dataset_path, tokenizer, rng, num_prompts, random_output_len)
    if dataset_name == "shared-prefix":
        # Its own module (it builds on this one), with its own flags: see benchlib.args.
        raise ValueError("the shared-prefix dataset is built by shared_prefix_requests")
    if dataset_name == "json-schema":
        raise ValueError("the json-schema dataset is built by json_schema_requests")
    if dataset_name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {dataset_name!r}; expected one of "
                         f"{', '.join(DATASET_NAMES)}")
    input_lens, output_lens, rng = sample_lengths(
        dataset_name, num_prompts, seed, random_input_len=random_input_len,
        random_output_len=random_output_len, random_range_ratio=random_range_ratio,
        long_fraction=long_fraction, long_input_range=long_input_range,
        short_input_range=short_input_range, output_range=output_range)
    return _synthetic(tokenizer, rng, input_lens, output_lens)


def _check_arrivals(request_rate: float, burstiness: float) -> None:
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")


def arrival_times(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start, the first at 0.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate whatever the
    burstiness, coefficient of variation 1/sqrt(burstiness) (1 = Poisson, < 1 burstier, > 1
    more regular). An infinite rate sends everything at once.
    """
    _check_arrivals(request_rate, burstiness)
    if num <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def stepped_arrival_times(num: int, request_rates: Sequence[float], burstiness: float,
                          seed: int) -> list[float]:
    """`arrival_times` whose rate steps: the requests split into len(request_rates)
    consecutive parts of (nearly) equal size, and the gap before each request is drawn at its
    part's rate. One rate is exactly `arrival_times` (same draws), so a plain run's arrivals do
    not change.

    `--load 0.4,0.9` is a load that steps from 40% to 90% of capacity halfway through: how a
    policy copes when the queue it planned for changes under it.
    """
    if not request_rates:
        raise ValueError("request_rates is empty")
    if len(request_rates) == 1:
        return arrival_times(num, request_rates[0], burstiness, seed)
    for rate in request_rates:
        _check_arrivals(rate, burstiness)
    if num <= 0:
        return []
    phase = np.arange(num) * len(request_rates) // num  # request i's part
    rates = np.asarray(request_rates, dtype=float)[phase[1:]]
    rng = np.random.default_rng(seed)
    # An infinite rate's scale is 0: that part arrives all at once when it begins.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rates * burstiness))
    return [0.0, *np.cumsum(gaps).tolist()]
