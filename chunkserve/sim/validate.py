"""`chunkserve sim --validate`: the real engine and the calibrated simulator, same workload.

Both replay the same requests at the same arrival offsets for each chunk size; the report is
the simulator's relative error on the numbers a user would tune by.

Two things make a single short run a poor judge on a shared CPU, so the report carries both
next to the errors:
- tail percentiles of a few dozen requests are nearly maxima, and whether one short request
  lands behind one long prefill flips with millisecond timing. `--repeats R` replays R
  workloads (seeds seed..seed+R-1) and computes every percentile over all their requests
  together.
- the machine's speed drifts by 5-20% over minutes (a shared VM). The cost model is therefore
  also scored on the real runs' own steps (predicted vs measured busy time, median per-step
  error): when that error is large, the profile is stale and the latency errors say more about
  the machine than about the simulator.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from chunkserve.bench.sweep import (
    RunResult,
    SweepPoint,
    parse_chunk_sizes,
    run_point,
    summarize,
    sweep_points,
)
from chunkserve.bench.sweep_cli import check_fits, parse_goodput, workload_from_args
from chunkserve.bench.workloads import BenchRequest, arrival_times
from chunkserve.sim.calibrate import last_step, load_profile
from chunkserve.sim.cost_model import LinearCostModel, step_time
from chunkserve.sim.simulator import SimConfig, length_requests, simulate

COMPARED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms",
            "output_throughput")


def relative_errors(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    return {k: (sim[k] - real[k]) / real[k] for k in COMPARED if real.get(k)}


def pool(runs: list[RunResult]) -> RunResult:
    """Several runs of one configuration as one: all their requests, their summed duration
    (so throughput is total tokens over total busy wall time)."""
    return RunResult(runs[0].point, [r for run in runs for r in run.results],
                     [rec for run in runs for rec in run.records],
                     sum(run.duration for run in runs))


@dataclass
class StepCosts:
    """Measured step durations of real runs beside the cost model's prediction for each."""

    measured: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.measured:
            return {}
        rel = sorted(abs(p - m) / m for p, m in zip(self.predicted, self.measured) if m > 0)
        return {
            "busy_time_error": (sum(self.predicted) - sum(self.measured)) / sum(self.measured),
            "median_abs_step_error": statistics.median(rel) if rel else 0.0,
            "num_steps": len(self.measured),
        }

    @staticmethod
    def merge(parts: list[StepCosts]) -> StepCosts:
        return StepCosts([m for c in parts for m in c.measured],
                         [p for c in parts for p in c.predicted])


@dataclass
class RealRun:
    """One real run of one configuration, with what its simulation needs."""

    point_index: int
    run: RunResult
    costs: StepCosts
    sim_requests: list[BenchRequest]
    arrivals: list[float]


def run_validation(args: argparse.Namespace) -> int:
    from chunkserve.model.factory import load_model

    if not os.path.isfile(args.hardware):
        raise ValueError("--validate compares against this machine: --hardware must be a "
                         "profile file written here by `chunkserve profile`")
    if args.request_rate is None:
        raise ValueError("--validate needs an explicit --request-rate (the same for both runs)")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    prof = load_profile(args.hardware)
    cost = LinearCostModel(prof["coefficients"], prof["name"])
    loaded = load_model(prof["model"], prof["dtype"], args.max_model_len)
    engine_kwargs: dict[str, Any] = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                         num_kv_blocks=args.num_kv_blocks)
    blocks = args.num_kv_blocks or prof["num_kv_blocks"]
    config = SimConfig(loaded.max_model_len, blocks, args.block_size, args.max_num_seqs)
    percentiles = [float(p) for p in args.percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    points = sweep_points(parse_chunk_sizes(args.chunk_sizes), args.scheduler, args.baseline)

    runs: list[RealRun] = []
    for rep in range(args.repeats):
        # Repeat r is the workload of seed + r: different requests and arrivals each time.
        rep_args = argparse.Namespace(**{**vars(args), "seed": args.seed + rep})
        requests = workload_from_args(rep_args, loaded.tokenizer)
        check_fits(requests, loaded.max_model_len)
        arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, rep_args.seed)
        sim_requests = length_requests([r.prompt_len for r in requests],
                                       [r.output_len for r in requests])
        # Configurations interleave within a repeat, so a slow spell of the machine hits all.
        for i, point in enumerate(points):
            costs = StepCosts()
            real = run_point(loaded, point, requests, arrivals, engine_kwargs,
                             on_step=_recorder(cost, costs))
            runs.append(RealRun(i, real, costs, sim_requests, arrivals))
            print(f"repeat {rep + 1}/{args.repeats} chunk_size={point.chunk_size!s:>5}: "
                  f"{len(requests)} requests in {real.duration:.1f} s", flush=True)

    rows = []
    for i, point in enumerate(points):
        mine = [run for run in runs if run.point_index == i]
        sims = [simulate(point, config, cost, run.sim_requests, run.arrivals) for run in mine]
        row = _row(point, [run.run for run in mine], sims, percentiles, goodput)
        row["step_cost"] = StepCosts.merge([run.costs for run in mine]).summary()
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write(validation_markdown(rows))
    print(validation_markdown(rows))
    return 0


def _recorder(cost: LinearCostModel, into: StepCosts) -> Any:
    def on_step(engine: Any) -> None:
        step = last_step(engine)
        if step is not None:
            into.measured.append(step[1])
            into.predicted.append(step_time(cost, step[0]))
    return on_step


def _row(point: SweepPoint, real_runs: list[RunResult], sim_runs: list[RunResult],
         percentiles: list[float], goodput: dict[str, float] | None) -> dict[str, Any]:
    real = summarize(pool(real_runs), percentiles, goodput)
    sim = summarize(pool(sim_runs), percentiles, goodput)
    return {
        "chunk_size": point.chunk_size, "scheduler": point.scheduler,
        "repeats": len(real_runs), "num_requests": sum(len(r.results) for r in real_runs),
        "real": {k: real[k] for k in COMPARED}, "sim": {k: sim[k] for k in COMPARED},
        "relative_error": relative_errors(real, sim),
    }


def validation_markdown(rows: list[dict[str, Any]]) -> str:
    n = rows[0]["num_requests"] if rows else 0
    reps = rows[0]["repeats"] if rows else 0
    lines = [f"Simulator relative error vs the real engine, (sim − real) / real; percentiles over "
             f"{n} requests ({reps} repeat(s)); real value in parentheses.", "",
             "| chunk_size | " + " | ".join(COMPARED) + " |", "|" + "---|" * (len(COMPARED) + 1)]
    for r in rows:
        cells = []
        for k in COMPARED:
            err = r["relative_error"].get(k)
            cells.append("–" if err is None else f"{err:+.1%} ({r['real'][k]:,.1f})")
        lines.append(f"| {r['chunk_size']} | " + " | ".join(cells) + " |")
    worst = max((abs(v) for r in rows for v in r["relative_error"].values()), default=0.0)
    lines += ["", f"Largest absolute error: {worst:.1%}.", "",
              "Cost model scored on the real runs' own steps (a large busy-time error means the "
              "machine ran at a different speed than when profiled):", "",
              "| chunk_size | steps | busy time error | median abs step error |",
              "|---|---|---|---|"]
    for r in rows:
        sc = r["step_cost"]
        if sc:
            lines.append(f"| {r['chunk_size']} | {sc['num_steps']} | "
                         f"{sc['busy_time_error']:+.1%} | {sc['median_abs_step_error']:.1%} |")
    lines.append("")
    return "\n".join(lines)
