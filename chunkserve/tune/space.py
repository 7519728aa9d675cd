"""The configurations `chunkserve tune` tries, and how they relate to each other.

Stage 1 is the budget ladder: static decode-first at every budget, plus the no-chunk baseline.
Stage 2 looks around the best rung only (a full cross product would multiply simulations for
settings that rarely matter away from it): vLLM V1's scheduler at that budget,
`long_prefill_token_threshold` at half and a quarter of it, and the adaptive policy at targets
read off the ladder itself (the ITL p99 the neighbouring static budgets reached), plus the ITL
SLO when one is given.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chunkserve.benchlib.sweep import SweepPoint

DEFAULT_BUDGETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
MIN_THRESHOLD = 32  # a per-request chunk smaller than this is all overhead
ITL_SLO_MARGIN = 0.9  # adaptive's target is a prediction: aim a little under the SLO


@dataclass(frozen=True)
class SearchSpace:
    budgets: tuple[int, ...] = DEFAULT_BUDGETS  # static decode-first ladder (stage 1)
    baseline: str | None = "prefill-first"  # the no-chunk scheduler; None: not tried
    vllm_v1: bool = True
    thresholds: bool = True
    adaptive: bool = True


def ladder(space: SearchSpace, max_model_len: int) -> list[SweepPoint]:
    """Stage 1: the static budgets (none above max_model_len: a longer step is never filled by
    one prompt, that is the no-chunk baseline) and the baseline."""
    budgets = sorted({b for b in space.budgets if b < max_model_len} or {max_model_len})
    points = [SweepPoint(b, "decode-first") for b in budgets]
    return points + ([SweepPoint(None, space.baseline)] if space.baseline else [])


def refinements(space: SearchSpace, best: SweepPoint, itl_p99_ms: dict[int, float],
                itl_slo_ms: float | None, cap: int) -> list[SweepPoint]:
    """Stage 2 around the best static budget `best`; `itl_p99_ms` maps each static budget to
    the ITL p99 it reached (where adaptive targets come from)."""
    if best.chunk_size is None:
        return []  # no chunking won: nothing to refine
    b = best.chunk_size
    points = []
    if space.vllm_v1:
        points.append(SweepPoint(b, "vllm-v1"))
    if space.thresholds:
        points += [SweepPoint(b, "decode-first", long_prefill_token_threshold=t)
                   for t in (b // 2, b // 4) if t >= MIN_THRESHOLD]
    if space.adaptive:
        points += [SweepPoint(cap, "decode-first", "adaptive", t)
                   for t in adaptive_targets(b, itl_p99_ms, itl_slo_ms)]
    return points


def adaptive_targets(best: int, itl_p99_ms: dict[int, float], itl_slo_ms: float | None
                     ) -> list[float]:
    """The ITL p99 of the best budget and of its neighbours on the ladder (adaptive with that
    target keeps the gap they had, sizing each step's chunk instead of fixing it), and the SLO."""
    budgets = sorted(itl_p99_ms)
    i = budgets.index(best)
    targets = {itl_p99_ms[b] for b in budgets[max(i - 1, 0): i + 2]}
    if itl_slo_ms is not None:
        targets.add(itl_slo_ms * ITL_SLO_MARGIN)
    # Rounded before they are told apart: two rungs with the same ITL p99 to 0.1 ms would
    # otherwise be simulated (and replayed) twice as two "different" targets.
    return sorted({round(t, 1) for t in targets})


# `auto` is compared with the pick, never ranked (tune/auto.py); its rank here is for order only.
SIMPLICITY = {"static": 0, "no-chunk": 1, "vllm-v1": 2, "threshold": 3, "adaptive": 4, "auto": 5}


def kind(point: SweepPoint) -> str:
    """The configuration's family, as the report names it."""
    if point.auto:
        return "auto"
    if point.no_chunk:
        return "no-chunk"
    if point.adaptive:
        return "adaptive"
    if point.long_prefill_token_threshold:
        return "threshold"
    return "vllm-v1" if point.scheduler == "vllm-v1" else "static"


def describe(point: SweepPoint) -> str:
    k = kind(point)
    if k == "auto":
        return (f"auto (adaptive, target {point.target_ms:g} ms"
                f"{'' if point.target_itl_ms is not None else ' by default'}, cap = the "
                "model's context)")
    if k == "no-chunk":
        return f"no chunking ({point.scheduler})"
    if k == "adaptive":
        return f"adaptive, target {point.target_itl_ms:g} ms (cap {point.chunk_size})"
    if k == "threshold":
        return (f"decode-first {point.chunk_size}, long_prefill_token_threshold "
                f"{point.long_prefill_token_threshold}")
    return f"{point.scheduler} {point.chunk_size}"


def neighbours(pick: SweepPoint, budget: int | None, static: Sequence[SweepPoint]
               ) -> tuple[SweepPoint | None, SweepPoint | None]:
    """The static ladder rungs just below and just above the pick's budget (`budget`: its own,
    or for adaptive the median it chose; None for no chunking, which is above every rung)."""
    rungs = sorted((p for p in static if p.chunk_size is not None and p != pick),
                   key=lambda p: p.chunk_size or 0)
    if budget is None:
        return (rungs[-1] if rungs else None), None
    below = [p for p in rungs if (p.chunk_size or 0) < budget]
    above = [p for p in rungs if (p.chunk_size or 0) > budget]
    return (below[-1] if below else None), (above[0] if above else None)
