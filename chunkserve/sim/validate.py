"""`chunkserve sim --validate`: the real engine and the calibrated simulator, same workload.

Both replay the same requests at the same arrival offsets for each chunk size; the report is
the simulator's relative error on the numbers a user would tune by.

The real runs are the expensive half (minutes each); they are saved to `real_runs.json.gz`
beside the report, with every step's shape and measured duration, and `--real-runs FILE`
scores the simulator against saved runs again (another profile, another cost model) in
seconds, without loading the model.

Two things make a single short run a poor judge on a shared CPU, so the report carries both
next to the errors:
- tail percentiles of a few dozen requests are nearly maxima, and whether one short request
  lands behind one long prefill flips with millisecond timing. `--repeats R` replays R
  workloads (seeds seed..seed+R-1) and computes every percentile over all their requests
  together.
- the machine's speed drifts by 5-20% over minutes (a shared VM). The cost model is therefore
  also scored on the real runs' own steps (predicted vs measured busy time, median per-step
  error): when that error is large, the profile is stale and the latency errors say more about
  the machine than about the simulator. Two more calibrations (CALIBRATIONS below) take the
  step costs from the real runs themselves, out of sample, to show the simulator's own error.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from chunkserve.benchlib.args import length_requests
from chunkserve.benchlib.metrics import RequestResult, parse_goodput, parse_percentiles
from chunkserve.benchlib.sweep import (
    AUTO,
    RunResult,
    SweepPoint,
    chunk_size_from_json,
    parse_chunk_sizes,
    summarize,
    sweep_point,
)
from chunkserve.sim.cost_model import CostModel, LinearCostModel, StepShape, step_time
from chunkserve.sim.fit import Sample, fit_linear, load_profile, profile_attention_layers
from chunkserve.sim.simulator import SimConfig, simulate
from chunkserve.sim.specs import AttentionLayers, profiled_kv_groups

COMPARED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms",
            "output_throughput")
RUNS_FILE = "real_runs.json.gz"
RUN_META = ("max_model_len", "num_kv_blocks", "block_size", "max_num_seqs")  # for SimConfig


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
    def of(steps: list[tuple[StepShape, float]], cost: CostModel) -> StepCosts:
        return StepCosts([d for _, d in steps], [step_time(cost, s) for s, _ in steps])

    @staticmethod
    def merge(parts: list[StepCosts]) -> StepCosts:
        return StepCosts([m for c in parts for m in c.measured],
                         [p for c in parts for p in c.predicted])


@dataclass
class RealRun:
    """One real run of one configuration: the workload it replayed, what every request
    measured and every step's shape and duration. All a simulation of it needs, and all a
    cost model can be scored on."""

    point: SweepPoint
    seed: int
    prompt_lens: list[int]
    output_lens: list[int]
    arrivals: list[float]
    results: list[RequestResult]
    duration: float
    steps: list[tuple[StepShape, float]]

    def as_run(self) -> RunResult:
        return RunResult(self.point, self.results, [], self.duration)

    def simulate(self, config: SimConfig, cost: CostModel) -> RunResult:
        return simulate(self.point, config, cost,
                        length_requests(self.prompt_lens, self.output_lens), self.arrivals)

    def to_json(self) -> dict[str, Any]:
        return {
            "chunk_size": self.point.label, "scheduler": self.point.scheduler,
            "seed": self.seed, "prompt_lens": self.prompt_lens, "output_lens": self.output_lens,
            "arrivals": self.arrivals, "duration": self.duration,
            "results": [{k: v for k, v in asdict(r).items() if k != "generated_text"}
                        for r in self.results],
            # [duration, [[chunk, cached], ...], [decode context, ...], sampled]
            "steps": [[d, s.prefill, s.decode_contexts, s.num_sampled] for s, d in self.steps],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RealRun:
        steps = [(StepShape([tuple(p) for p in pre], list(dec), sampled), dur)
                 for dur, pre, dec, sampled in d["steps"]]
        # Saved runs are static: "none" is the no-chunk baseline under its own scheduler.
        point = sweep_point(chunk_size_from_json(d["chunk_size"]), d["scheduler"], d["scheduler"])
        return cls(point, d["seed"],
                   d["prompt_lens"],
                   d["output_lens"], d["arrivals"], [RequestResult(**r) for r in d["results"]],
                   d["duration"], steps)


def save_runs(path: str, runs: list[RealRun], meta: dict[str, Any]) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({**meta, "runs": [r.to_json() for r in runs]}, f)


def load_runs(path: str) -> tuple[list[RealRun], dict[str, Any]]:
    try:
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        runs = [RealRun.from_json(r) for r in data.pop("runs")]
        missing = [k for k in RUN_META if k not in data]
        if missing or not runs:
            raise ValueError(f"missing {', '.join(missing) or 'runs'}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a file of real runs written by `--validate` ({e})") from e
    return runs, data


def load_all_runs(paths: list[str]) -> tuple[list[RealRun], dict[str, Any]]:
    """Saved runs of several --validate invocations, pooled: more requests behind every
    percentile. They must describe the same engine configuration."""
    runs, meta = load_runs(paths[0])
    for path in paths[1:]:
        more, other = load_runs(path)
        differ = [k for k in RUN_META if other[k] != meta[k]]
        if differ:
            raise ValueError(f"{path} was run with a different {', '.join(differ)} than "
                             f"{paths[0]}; only runs of one configuration can be pooled")
        runs += more
    return runs, meta


# Runs the real engine for --validate: (runs, the engine configuration they share). It lives
# with the benchmarks (bench/validation_runs.py) and is handed in by the command line, so the
# simulator never loads a model.
MeasureRealRuns = Callable[[argparse.Namespace, dict[str, Any]], tuple[list["RealRun"], dict[str, Any]]]


# ---- which cost model prices each run ----------------------------------------------------------
# The simulator is only as right as the step costs it is given, and on a shared VM the step
# costs move: runs took 0.81-1.22x the busy time a profile predicted, from one 90-second run to
# the next. Scoring three calibrations separates the simulator's error from the machine's.
CALIBRATIONS = {
    "profile": "the profile file as given: what `chunkserve sim --hardware profile.json` "
               "predicts (includes the machine's drift since profiling)",
    "held_out": "cost model fitted on the real steps of the *other* chunk sizes (all repeats): "
                "a chunk size predicted from runs that never used it",
    "held_out_speed": "held_out, scaled by each run's measured machine speed (its busy time "
                      "over the held-out model's prediction, one number per run)",
}


def speed_factor(cost: CostModel, steps: list[tuple[StepShape, float]]) -> float:
    """How much slower the machine ran these steps than `cost` predicts (1.0: as predicted)."""
    predicted = sum(step_time(cost, s) for s, _ in steps)
    return sum(d for _, d in steps) / predicted if predicted > 0 else 1.0


def scaled(cost: LinearCostModel, factor: float) -> LinearCostModel:
    return dataclasses.replace(cost, coefficients={k: v * factor
                                                   for k, v in cost.coefficients.items()})


def held_out_model(runs: list[RealRun], point: SweepPoint,
                   attention_layers: AttentionLayers | None = None) -> LinearCostModel:
    """The linear cost model fitted on every real step of the configurations other than
    `point`: out of sample for `point` by construction. `attention_layers`: the profile's
    (windowed features for a sliding-window model; None: full attention)."""
    samples = [Sample("workload", s, d) for r in runs if r.point != point for s, d in r.steps]
    return LinearCostModel(fit_linear(samples, attention_layers=attention_layers),
                           f"held out {point.label}", attention_layers)


def configurations(runs: list[RealRun]) -> list[SweepPoint]:
    """The distinct configurations of `runs`, in run order."""
    points: list[SweepPoint] = []
    for run in runs:
        if run.point not in points:
            points.append(run.point)
    return points


def run_costs(runs: list[RealRun], calibration: str, profile: CostModel) -> list[CostModel]:
    """The cost model that prices each run under `calibration` (see CALIBRATIONS)."""
    if calibration == "profile":
        return [profile] * len(runs)
    points = configurations(runs)
    layers = profile.attention_layers if isinstance(profile, LinearCostModel) else None
    models = [held_out_model(runs, point, layers) for point in points]
    costs: list[CostModel] = []
    for run in runs:
        model = models[points.index(run.point)]
        costs.append(scaled(model, speed_factor(model, run.steps))
                     if calibration == "held_out_speed" else model)
    return costs


def score(runs: list[RealRun], costs: list[CostModel], config: SimConfig,
          percentiles: list[float], goodput: dict[str, float] | None) -> list[dict[str, Any]]:
    """One row per configuration: real and simulated metrics pooled over the repeats; run i
    is simulated with costs[i]."""
    rows = []
    for point in configurations(runs):
        mine = [i for i, run in enumerate(runs) if run.point == point]
        real = summarize(pool([runs[i].as_run() for i in mine]), percentiles, goodput)
        sims = [runs[i].simulate(config, costs[i]) for i in mine]
        sim = summarize(pool(sims), percentiles, goodput)
        rows.append({
            "chunk_size": point.label, "scheduler": point.scheduler,
            "repeats": len(mine), "num_requests": sum(len(runs[i].results) for i in mine),
            "real": {k: real[k] for k in COMPARED}, "sim": {k: sim[k] for k in COMPARED},
            "relative_error": relative_errors(real, sim),
            "step_cost": StepCosts.merge(
                [StepCosts.of(runs[i].steps, costs[i]) for i in mine]).summary(),
        })
    return rows


def validate(runs: list[RealRun], profile: CostModel, config: SimConfig,
             percentiles: list[float], goodput: dict[str, float] | None) -> dict[str, Any]:
    """validation.json: the rows of every calibration, and the machine's speed per run."""
    # Held out needs another configuration to fit on.
    several = len(configurations(runs)) > 1
    calibrations = [c for c in CALIBRATIONS if c == "profile" or several]
    return {
        "calibrations": {c: score(runs, run_costs(runs, c, profile), config, percentiles,
                                  goodput) for c in calibrations},
        "runs": [{"seed": r.seed, "chunk_size": r.point.label,
                  "duration": r.duration, "num_steps": len(r.steps),
                  "speed_vs_profile": speed_factor(profile, r.steps)} for r in runs],
    }


def run_validation(args: argparse.Namespace, measure_real_runs: MeasureRealRuns | None) -> int:
    if not os.path.isfile(args.hardware):
        raise ValueError("--validate compares against this machine: --hardware must be a "
                         "profile file written here by `chunkserve profile`")
    if args.chunk_policy == "adaptive" or AUTO in parse_chunk_sizes(args.chunk_sizes):
        raise ValueError("--validate scores static chunk sizes; run it without --chunk-policy "
                         "adaptive and without 'auto' (its saved real runs are static)")
    prof = load_profile(args.hardware)
    cost = LinearCostModel(prof["coefficients"], prof["name"], profile_attention_layers(prof))
    if args.real_runs:
        runs, meta = load_all_runs(args.real_runs)
    else:
        if args.request_rate is None:
            raise ValueError("--validate needs an explicit --request-rate (the same for both runs)")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        if measure_real_runs is None:
            raise ValueError("--validate without --real-runs needs the real engine")
        runs, meta = measure_real_runs(args, prof)
        os.makedirs(args.out, exist_ok=True)
        save_runs(os.path.join(args.out, RUNS_FILE), runs, meta)
    # The real runs' engine grouped a sliding-window model's layers: so does the replay.
    groups = profiled_kv_groups(meta.get("model", prof["model"]), meta["max_model_len"])
    config = SimConfig(meta["max_model_len"], meta["num_kv_blocks"], meta["block_size"],
                       meta["max_num_seqs"], kv_cache_groups=groups)
    percentiles = parse_percentiles(args.percentiles)
    report = validate(runs, cost, config, percentiles, parse_goodput(args.goodput))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write(validation_markdown(report))
    print(validation_markdown(report))
    return 0


def validation_markdown(report: dict[str, Any]) -> str:
    calibrations: dict[str, list[dict[str, Any]]] = report["calibrations"]
    first = calibrations["profile"]
    n, reps = first[0]["num_requests"], first[0]["repeats"]
    lines = [f"Simulator relative error vs the real engine, (sim − real) / real, percentiles over "
             f"{n} requests ({reps} repeat(s)), real value in parentheses; the last two columns "
             "score the cost model on the real runs' own steps.", ""]
    for name, rows in calibrations.items():
        cells = [v for r in rows for v in r["relative_error"].values()]
        within = sum(abs(v) <= 0.10 for v in cells)
        lines += [f"**{name}** — {CALIBRATIONS[name]}.", "",
                  "| chunk_size | " + " | ".join(COMPARED) + " | busy time | step (median) |",
                  "|" + "---|" * (len(COMPARED) + 3)]
        for r in rows:
            row = [f"{r['relative_error'][k]:+.1%} ({r['real'][k]:,.1f})"
                   if k in r["relative_error"] else "–" for k in COMPARED]
            sc = r["step_cost"]
            row += [f"{sc['busy_time_error']:+.1%}", f"{sc['median_abs_step_error']:.1%}"]
            lines.append(f"| {r['chunk_size']} | " + " | ".join(row) + " |")
        worst = max((abs(v) for v in cells), default=0.0)
        lines += ["", f"Largest absolute error {worst:.1%}; {within} of {len(cells)} cells "
                      "within 10%.", ""]
    speeds = sorted(r["speed_vs_profile"] for r in report["runs"])
    if speeds:
        lines += [f"Machine speed per run, measured busy time / the profile's prediction: "
                  f"{speeds[0]:.2f}–{speeds[-1]:.2f} (median {statistics.median(speeds):.2f}) "
                  f"over {len(speeds)} runs.", ""]
    return "\n".join(lines)
