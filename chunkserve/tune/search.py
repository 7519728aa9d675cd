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
from chunkserve.tune.slo import goodput_slos, meets, objective_value, slo_ratios
from chunkserve.tune.space import SIMPLICITY, SearchSpace, kind, ladder, refinements

PERCENTILES = [50.0, 90.0, 99.0]
# Configurations within this much of the best objective value are a tie, and the simplest one
# wins: the simulator's error is larger than that (docs/results/sim-validation-cpu).
TIE = 0.01


@dataclass(eq=False)  # compared by identity: a run holds every request and step
class Evaluated:
    point: SweepPoint
    entry: dict[str, Any]  # results.json's keys for the run
    run: RunResult

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


def evaluate(point: SweepPoint, bench: Workbench, slos: dict[str, float]) -> Evaluated:
    run = bench.run(point)
    return Evaluated(point, summarize(run, PERCENTILES, goodput_slos(slos)), run)


def search(bench: Workbench, space: SearchSpace, slos: dict[str, float],
           objective: str) -> TuneResult:
    stage1 = [evaluate(p, bench, slos) for p in ladder(space, bench.config.max_model_len)]
    static = [e for e in stage1 if e.point.chunk_size is not None]
    best = rank(static, slos, objective)[0].point if static else stage1[0].point
    itl = {e.point.chunk_size: e.entry["p99_itl_ms"] for e in static}
    cap = max(itl, default=bench.config.max_model_len)
    stage2, skipped = [], []
    for point in refinements(space, best, itl, slos.get("itl_p99"), cap):
        try:
            stage2.append(evaluate(point, bench, slos))
        except ValueError as e:  # e.g. an adaptive target below one decode step
            skipped.append(f"{point}: {e}")
    ranked = rank(stage1 + stage2, slos, objective)
    return TuneResult(ranked, stage1, skipped, num_tied(ranked, slos, objective))


def worst_ratio(e: Evaluated, slos: dict[str, float]) -> float:
    """How far the worst SLO is from its limit (≤ 1: all met; 0 without SLOs)."""
    return max(slo_ratios(e.entry, slos).values(), default=0.0)


def num_tied(ranked: list[Evaluated], slos: dict[str, float], objective: str) -> int:
    feasible = [objective_value(e.entry, objective) for e in ranked if meets(e.entry, slos)]
    return sum(v >= max(feasible) - TIE * abs(max(feasible)) for v in feasible) if feasible else 0


def rank(evals: list[Evaluated], slos: dict[str, float], objective: str) -> list[Evaluated]:
    """Configurations meeting every SLO first, by objective; a tie (within TIE of the best)
    goes to the simplest. Then the rest, closest to meeting their SLOs first."""
    feasible = sorted((e for e in evals if meets(e.entry, slos)),
                      key=lambda e: -objective_value(e.entry, objective))
    infeasible = sorted((e for e in evals if not meets(e.entry, slos)),
                        key=lambda e: worst_ratio(e, slos))
    if not feasible:
        return infeasible
    best = objective_value(feasible[0].entry, objective)
    tied = [e for e in feasible if objective_value(e.entry, objective) >= best - TIE * abs(best)]
    # Among equals: the simplest, then the most headroom on the tightest SLO (the simulator's
    # error is ~10%, so a pick right at a limit may miss it for real), then the objective.
    tied.sort(key=lambda e: (SIMPLICITY[kind(e.point)], round(worst_ratio(e, slos), 2),
                             -objective_value(e.entry, objective)))
    return tied + [e for e in feasible if e not in tied] + infeasible  # `in`: identity
