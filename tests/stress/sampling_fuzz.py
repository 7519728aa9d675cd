"""Sampling parameters at and past their bounds (issue 51), and what the API promises for each:
the oracle that tests/test_isolation_server.py draws from with hypothesis and the soak mixes into
its load (`make stress`).

The ranges are written out here, apart from SamplingParams: they are what docs/reliability.md
promises, so a bound that moves in the code without the docs fails the tests.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

INT64_MAX = (1 << 63) - 1


def _between(low: float, high: float, low_open: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (low < v if low_open else low <= v) and v <= high)
    return ok


def _int_between(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _near(*xs: float) -> list[float]:
    """Each bound and the floats just either side of it."""
    return [y for x in xs for y in (math.nextafter(x, -math.inf), x, math.nextafter(x, math.inf))]


# Denormals, ±0, the extremes, and JSON's NaN/Infinity literals (json.dumps writes them).
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-320, 2.2250738585072014e-308, 1e-5, 0.5, 1.0, 2.0,
               1e308, -1e308, -1.0, math.nan, math.inf, -math.inf]

# field -> (whether a value is in range, values to try: inside, on the edges, just outside).
# max_tokens and n are kept small where valid, so that an accepted request costs little.
RANGES: dict[str, tuple[Callable[[Any], bool], list[Any]]] = {
    "temperature": (_between(0.0, 100.0), EDGE_FLOATS + _near(0.0, 100.0)),
    "top_p": (_between(0.0, 1.0, low_open=True), EDGE_FLOATS + _near(0.0, 1.0)),
    "min_p": (_between(0.0, 1.0), EDGE_FLOATS + _near(0.0, 1.0)),
    "presence_penalty": (_between(-2.0, 2.0), EDGE_FLOATS + _near(-2.0, 2.0)),
    "frequency_penalty": (_between(-2.0, 2.0), EDGE_FLOATS + _near(-2.0, 2.0)),
    "repetition_penalty": (_between(0.01, 100.0), EDGE_FLOATS + _near(0.01, 100.0)),
    "top_k": (_int_between(-1, INT64_MAX), [-2, -1, 0, 1, 7, INT64_MAX, INT64_MAX + 1]),
    "seed": (_int_between(-INT64_MAX - 1, INT64_MAX),
             [0, -1, 7, INT64_MAX, INT64_MAX + 1, -INT64_MAX - 1, -INT64_MAX - 2]),
    "max_tokens": (_int_between(1, 3), [-1, 0, 1, 3, 10**6, 1 << 64]),
    "n": (_int_between(1, 2), [-1, 0, 1, 2, 16385, 1 << 64]),
    "logprobs": (_int_between(0, 20), [-1, 0, 2, 20, 21]),
}
FIELDS = sorted(RANGES)
# logit_bias values are clamped to [-100, 100] (vLLM's rule): only non-finite ones are refused.
BIAS_TOKEN = "300"
BIAS_VALUES = [0.0, -0.0, 5e-324, 1e308, -1e308, 100.0, 100.5, math.nan, math.inf]


def expected_bad(body: dict[str, Any]) -> set[str]:
    """The fields of `body` out of their range: a 4xx must name one; none, and it is a 200."""
    bad = {name for name, value in body.items()
           if name in RANGES and not RANGES[name][0](value)}
    if "logit_bias" in body and not math.isfinite(body["logit_bias"][BIAS_TOKEN]):
        bad.add("logit_bias")
    return bad


def random_fields(rng: random.Random) -> dict[str, Any]:
    """One to four fields at their edges, and sometimes a logit_bias (the soak's draw)."""
    fields = {name: rng.choice(RANGES[name][1]) for name in rng.sample(FIELDS, rng.randint(1, 4))}
    if rng.random() < 0.5:
        fields["logit_bias"] = {BIAS_TOKEN: rng.choice(BIAS_VALUES)}
    return fields


def is_refusal_naming(status: int, error: dict[str, Any], bad: set[str]) -> bool:
    """Whether a response is a 4xx in OpenAI's shape that names one of the `bad` fields."""
    named = {error.get("param")} | {f for f in bad if f in str(error.get("message", ""))}
    return 400 <= status < 500 and error.get("code") == status and bool(named & bad)
