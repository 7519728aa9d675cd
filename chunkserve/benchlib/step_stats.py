"""What the step trace says about a run: step times, fixed per-step cost, KV pressure.

The "chunk too small" failure shows as a large fixed cost per step: fit step duration against
tokens per step (duration ≈ a + b·tokens); the intercept `a` is what every step pays whatever
it carries, and a/mean(duration) is the share of time spent on it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from chunkserve.engine.trace import StepRecord


def linear_fit(tokens: Sequence[float], durations: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of duration against tokens; slope 0 if degenerate."""
    x = np.asarray(tokens, dtype=float)
    y = np.asarray(durations, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(y.mean()) if len(y) else 0.0, 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def step_metrics(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Our per-run step metrics, under the key names results.json uses."""
    busy = [r for r in records if r.num_tokens > 0]
    if not busy:
        return {
            "num_steps": 0, "mean_step_ms": 0.0, "p99_step_ms": 0.0, "max_step_ms": 0.0,
            "mean_tokens_per_step": 0.0, "step_overhead_ms": 0.0, "step_overhead_share": 0.0,
            "num_preemptions": sum(r.num_preemptions for r in records),
            "peak_kv_usage": max((r.kv_usage for r in records), default=0.0),
            "mean_internal_fragmentation_tokens": 0.0,
        }
    durations = np.array([r.duration for r in busy])
    tokens = np.array([r.num_tokens for r in busy])
    intercept, _ = linear_fit(tokens, durations)
    intercept = max(intercept, 0.0)  # a negative fit means no measurable fixed cost
    return {
        "num_steps": len(busy),
        "mean_step_ms": float(durations.mean() * 1000),
        "p99_step_ms": float(np.percentile(durations, 99) * 1000),
        "max_step_ms": float(durations.max() * 1000),
        "mean_tokens_per_step": float(tokens.mean()),
        "step_overhead_ms": intercept * 1000,
        "step_overhead_share": float(min(intercept / durations.mean(), 1.0)),
        "num_preemptions": int(sum(r.num_preemptions for r in records)),
        "peak_kv_usage": float(max(r.kv_usage for r in records)),
        "mean_internal_fragmentation_tokens": float(
            np.mean([r.internal_fragmentation for r in busy])
        ),
    }
