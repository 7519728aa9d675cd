"""The search: simulate each configuration on one workload and arrivals, rank, pick.

Every configuration runs the same requests at the same arrival times on the simulator (the
engine's own loop on a cost model), so the ranking compares configurations, not workloads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from chunkserve.benchlib.sweep import RunResult, SweepPoint, summarize
from chunkserve.sim.simulator import Workbench
from chunkserve.tune.slo import all_per_request, goodput_slos, meets, objective_value, slo_ratios
from chunkserve.tune.space import SIMPLICITY, SearchSpace, kind, ladder, refinements

PERCENTILES = [50.0, 90.0, 99.0]
# Configurations within this much of the best objective value are a tie, and the simplest one
# wins: the simulator's error is larger than that (docs/results/sim-validation-cpu).
TIE = 0.01
# With a measured profile, each configuration is also simulated on a machine this much slower
# than the profile: it is taken once, and a shared host then drifts (its runs measured
# 0.81-1.04x the profile's speed on one host, 1.3-2x slower on another: docs/results/tune). A
# configuration that meets the SLOs only at the profile's exact speed (no chunking near
# capacity, whose queue grows without bound a little past it) is not a safe pick. A hardware
# preset describes a dedicated GPU from its datasheet: no drift to allow for, no margin.
PROFILE_SPEED_MARGIN = 1.25


@dataclass(eq=False)  # compared by identity: a run holds every request and step
class Evaluated:
    point: SweepPoint
    entry: dict[str, Any]  # results.json's keys for the run
    run: RunResult
    slow_entry: dict[str, Any] | None = None  # the same run on the slower machine (margin)

    @property
    def judged(self) -> list[dict[str, Any]]:
        """The runs a configuration is held to: it must do well in every one of them."""
        return [self.entry] + ([self.slow_entry] if self.slow_entry is not None else [])

    def meets(self, slos: dict[str, float]) -> bool:
        return all(meets(entry, slos) for entry in self.judged)

    def value(self, objective: str) -> float:
        """The objective in the worse of its runs."""
        return min(objective_value(entry, objective) for entry in self.judged)

    def worst_ratio(self, slos: dict[str, float]) -> float:
        """How far the worst SLO is from its limit in the worse run (≤ 1: all met; 0 without
        SLOs)."""
        return max((r for entry in self.judged for r in slo_ratios(entry, slos).values()),
                   default=0.0)

    @property
    def budget(self) -> int | None:
        """The step budget it ran at: its own, or for adaptive the median it chose."""
        if not self.point.adaptive:
            return self.point.chunk_size
        chosen = [r.token_budget for r in self.run.records if r.num_prefill_tokens and r.token_budget]
        return int(median(chosen)) if chosen else self.point.chunk_size


@dataclass
class TuneResult:
    ranked: list[Evaluated]  # best first
    ladder: list[Evaluated]  # stage 1, in ladder order
    skipped: list[str] = field(default_factory=list)  # configurations that could not run, why
    tied: int = 1  # configurations within TIE of the best objective value (the pick among them)

    @property
    def pick(self) -> Evaluated:
        return self.ranked[0]


def evaluate(point: SweepPoint, bench: Workbench, slos: dict[str, float],
             speed_margin: float = 1.0) -> Evaluated:
    """One configuration at the cost model's speed and, with a margin > 1, that much slower."""
    limits = goodput_slos(slos)
    run = bench.run(point)
    slow = summarize(bench.run(point, speed_margin), PERCENTILES, limits) \
        if speed_margin != 1.0 else None
    return Evaluated(point, summarize(run, PERCENTILES, limits), run, slow)


def search(bench: Workbench, space: SearchSpace, slos: dict[str, float], objective: str,
           speed_margin: float = 1.0) -> TuneResult:
    stage1 = [evaluate(p, bench, slos, speed_margin)
              for p in ladder(space, bench.config.max_model_len)]
    static = [e for e in stage1 if e.point.chunk_size is not None]
    best = rank(static, slos, objective)[0].point if static else stage1[0].point
    itl = {e.point.chunk_size: e.entry["p99_itl_ms"] for e in static}
    cap = max(itl, default=bench.config.max_model_len)
    stage2, skipped = [], []
    for point in refinements(space, best, itl, slos.get("itl_p99"), cap):
        try:
            stage2.append(evaluate(point, bench, slos, speed_margin))
        except ValueError as e:  # e.g. an adaptive target below one decode step
            skipped.append(f"{point}: {e}")
    ranked = rank(stage1 + stage2, slos, objective)
    return TuneResult(ranked, stage1, skipped, num_tied(ranked, slos, objective))


def num_tied(ranked: list[Evaluated], slos: dict[str, float], objective: str) -> int:
    feasible = [e.value(objective) for e in ranked if e.meets(slos)]
    return sum(v >= max(feasible) - TIE * abs(max(feasible)) for v in feasible) if feasible else 0


def closeness(e: Evaluated, slos: dict[str, float], objective: str) -> float:
    """How a configuration that misses an SLO ranks among such (lower first). Goodput counts
    only the requests that met their own SLOs, so when every SLO is a per-request one it is how
    close a run came; a single percentile's ratio is not (near capacity, no chunking's growing
    queue misses for most requests while its p99 is a little lower than a chunked run's).
    Otherwise (other objectives, or an ITL SLO, which goodput cannot see): the worst SLO's
    ratio to its limit."""
    if objective == "goodput" and all_per_request(slos):
        return -e.value(objective)
    return e.worst_ratio(slos)


def rank(evals: list[Evaluated], slos: dict[str, float], objective: str) -> list[Evaluated]:
    """Configurations meeting every SLO (in every run they are held to) first, by objective
    (in their worse run); a tie (within TIE of the best) goes to the simplest. Then the rest,
    closest to meeting their SLOs first (`closeness`)."""
    feasible = sorted((e for e in evals if e.meets(slos)), key=lambda e: -e.value(objective))
    infeasible = sorted((e for e in evals if not e.meets(slos)),
                        key=lambda e: closeness(e, slos, objective))
    if not feasible:
        return infeasible
    best = feasible[0].value(objective)
    tied = [e for e in feasible if e.value(objective) >= best - TIE * abs(best)]
    # Among equals: the simplest, then the most headroom on the tightest SLO (the simulator's
    # error is ~10%, so a pick right at a limit may miss it for real), then the objective.
    tied.sort(key=lambda e: (SIMPLICITY[kind(e.point)], round(e.worst_ratio(slos), 2),
                             -e.value(objective)))
    return tied + [e for e in feasible if e not in tied] + infeasible  # `in`: identity
