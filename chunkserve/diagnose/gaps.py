"""Token gaps rebuilt from a step trace, and the step-time fit used to explain them.

A trace has one record per step, not per token, so gaps are reconstructed at step level: a
request that decodes in step i got its previous token at the end of the last earlier step that
had decodes (decode-first runs every decode every step; prefill-first skips them during prefill
steps, and those steps land inside the gap). The gap is end(i) − end(j), and it counts once
per decode in step i. A request's first decode after its own prefill is counted from the
previous decode step too (an overestimate of at most that step), and a preempted request's
long wait is rebuilt separately (causes.py: recompute). A hole between steps means the engine
was idle, and a step whose running requests all prefill has nobody decoding: either way gaps
restart there.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chunkserve.engine.trace import StepRecord


@dataclass
class Gap:
    first: int  # index of the first step inside the gap
    last: int  # index of the step whose end is the token
    seconds: float
    count: int  # decodes whose token ended this gap


def end(r: StepRecord) -> float:
    return r.start + r.duration


# Longer than any scheduling hiccup between two steps of a busy engine; the benchmarks' replay
# and the server only leave such a hole when nothing is running.
IDLE_HOLE_S = 0.005


def token_gaps(records: Sequence[StepRecord]) -> list[Gap]:
    gaps: list[Gap] = []
    prev: int | None = None  # the last step that produced tokens for running requests
    for i, r in enumerate(records):
        if i and r.start - end(records[i - 1]) > IDLE_HOLE_S:
            prev = i if not r.num_decode_reqs else i - 1
        if not r.num_decode_reqs:
            if r.num_running <= r.num_prefill_reqs:
                prev = i  # every running request was prefilling: nobody was waiting for a token
            continue
        j = prev if prev is not None else i - 1
        since = end(records[j]) if j >= 0 else r.start
        gaps.append(Gap(j + 1, i, end(r) - since, r.num_decode_reqs))
        prev = i
    return gaps


def weighted_percentile(gaps: Sequence[Gap], q: float) -> float:
    """The q-th percentile of gap lengths, each gap repeated `count` times (np.percentile's
    linear interpolation, like the benchmarks' ITL p99)."""
    values = np.repeat([g.seconds for g in gaps], [g.count for g in gaps])
    return float(np.percentile(values, q))


def attention_work(r: StepRecord, after_prefix: bool) -> float:
    """Σ chunk · (cached + chunk/2) over the step's prefills: with cached context or without."""
    return float(sum(n * (c + n / 2) for _, n, c in r.prefill_requests if (c > 0) == after_prefix))


@dataclass
class StepFit:
    """duration ≈ overhead + per_token · tokens + per_pair · attention pairs (all prefills)."""

    overhead: float  # seconds every step pays, whatever it carries
    per_token: float
    per_pair: float  # 0 for traces without prefill_requests

    def tokens_within(self, seconds: float) -> int:
        """Tokens a step can carry in `seconds` (attention left out: a first chunk has none)."""
        if self.per_token <= 0:
            return 0
        return max(int((seconds - self.overhead) / self.per_token), 0)


def fit_steps(records: Sequence[StepRecord]) -> StepFit:
    """Least squares on relative error (a 20 ms step matters as much as a 2 s one), dropping any
    term that wants a negative coefficient: a fixed cost or a cost per token is never negative."""
    busy = [r for r in records if r.num_tokens]
    X = np.array([[1.0, r.num_tokens, attention_work(r, False) + attention_work(r, True)]
                  for r in busy])
    y = np.array([r.duration for r in busy])
    w = 1.0 / np.maximum(y, 1e-9)
    active = [k for k in range(3) if X[:, k].any()]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return StepFit(float(coef[0]), float(coef[1]), float(coef[2]))
