"""`auto` beside tune's pick: what `chunkserve serve` runs with no chunking flag (the adaptive
policy toward the default token-gap target, capped by the model's context), simulated on the
same workbench, and how it compares with the recommendation.

It is reported, not ranked: the question a user has is whether the default is good enough here
or the pick's flags are worth setting. In the simulator the cost model stands in for the
engine's online fit (on the slower machine of --speed-margin too: the online model learns the
machine it runs on, where a pick's fixed profile does not).
"""
from __future__ import annotations

from typing import Any

from chunkserve.benchlib.sweep import AUTO, SweepPoint, sweep_point
from chunkserve.sim.simulator import Workbench
from chunkserve.tune.report import AUTO_COMPARED, candidate
from chunkserve.tune.search import Evaluated, evaluate


def auto_point(scheduler: str = "decode-first") -> SweepPoint:
    """The `auto` entry of --chunk-sizes, at the default target."""
    return sweep_point(AUTO, scheduler, scheduler)


def evaluate_auto(bench: Workbench, slos: dict[str, float], speed_margin: float) -> Evaluated:
    return evaluate(auto_point(), bench, slos, speed_margin)


def versus(auto: dict[str, Any], pick: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each compared metric: auto's, the pick's, and auto's change relative to the pick."""
    return {key: {"auto": auto.get(key), "pick": pick.get(key),
                  "change": change(auto.get(key), pick.get(key))} for key, *_ in AUTO_COMPARED}


def auto_dict(auto: Evaluated, pick: Evaluated, slos: dict[str, float], objective: str,
              command: str) -> dict[str, Any]:
    """The --json `auto` object: auto as a candidate, its command line, and the comparison."""
    mine, theirs = candidate(auto, slos, objective), candidate(pick, slos, objective)
    return {**mine, "command": command, "vs_pick": versus(mine, theirs),
            "pick_meets_slos": theirs["meets_slos"],
            "objective_vs_pick": change(mine["objective_value"], theirs["objective_value"])}


def change(a: float | None, b: float | None) -> float | None:
    """(a - b) / |b|: + is more (|b|: the ttft objective's values are negative)."""
    return (a - b) / abs(b) if a is not None and b else None
