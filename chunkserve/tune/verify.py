"""`chunkserve tune --verify`: the pick and its two neighbours on the real engine, predicted
against measured.

The real runs are made by a function the command line passes in (`bench/tune_runs.py`, on
`bench sweep`'s run_point): tune, like the simulator, never loads a model itself.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from chunkserve.benchlib.sweep import RunResult, SweepPoint, summarize
from chunkserve.sim.simulator import Workbench
from chunkserve.tune.search import PERCENTILES, Evaluated
from chunkserve.tune.slo import entry_key, goodput_slos
from chunkserve.tune.space import describe

# (args, configurations, arrivals, KV blocks the simulation had) -> one real run each
MeasureRuns = Callable[[argparse.Namespace, list[SweepPoint], Sequence[float], int],
                       list[RunResult]]
COMPARED = ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "output_throughput")


def verify_points(pick: Evaluated, below: Evaluated | None, above: Evaluated | None,
                  ranked: Sequence[Evaluated]) -> list[Evaluated]:
    """The pick and two neighbours: below and above it, or the two nearest on one side at an
    end of the ladder (the runner-up when the ladder has no second one)."""
    chosen = [pick] + [e for e in (below, above) if e is not None]
    for e in ranked:
        if len(chosen) >= 3:
            break
        if all(e is not c for c in chosen):
            chosen.append(e)
    return chosen


def verify(args: argparse.Namespace, evals: list[Evaluated], bench: Workbench,
           slos: dict[str, float], measure: MeasureRuns) -> list[dict[str, Any]]:
    runs = measure(args, [e.point for e in evals], bench.arrivals, bench.config.num_kv_blocks)
    keys = list(dict.fromkeys(list(COMPARED) + [entry_key(k) for k in slos]))
    rows = []
    for e, run in zip(evals, runs):
        real = summarize(run, PERCENTILES, goodput_slos(slos))
        rows.append({"config": describe(e.point), "metrics": {
            k: {"predicted": e.entry[k], "measured": real[k],
                "error": (e.entry[k] - real[k]) / real[k] if real[k] else None} for k in keys}})
    return rows


def format_verify(rows: list[dict[str, Any]]) -> str:
    lines = ["", "verify (real engine): predicted / measured (error)"]
    for row in rows:
        cells = ", ".join(
            f"{k} {m['predicted']:,.1f} / {m['measured']:,.1f}"
            + ("" if m["error"] is None else f" ({m['error']:+.0%})")
            for k, m in row["metrics"].items())
        lines.append(f"  {row['config']}: {cells}")
    return "\n".join(lines)
