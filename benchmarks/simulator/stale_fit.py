"""How fast does the engine's step-time model recover from a wrong warm start, under load?

The adaptive chunk policy plans with `OnlineCostModel`, warm-started from a probe cached per
machine and model (sim/online_model.py). A cached probe can be wrong: the host got busier or
quieter since, or the kernels changed. This replays the served comparison's capacity phase
(the mixed workload, seed 0, 48 requests, 16 at a time) on the simulator, whose engine loop is
the real one, with the online model in it: it plans every step, sees every simulated step's
duration and refits as it would serving. The machine is a linear cost model with 5% noise per
step; the warm starts are the real probe (engine/step_probe.py) run on:

- `fresh`: the machine itself;
- `2x slow` / `2x fast`: the machine at twice / half its step times;
- `older kernels`: a probe of the same model on this host kind with the kernels of a day
  earlier (slower chunk attention, another split between per-step and per-token costs);
- and `oracle`: no learning, the planner is the machine's own cost model.

    .venv/bin/python benchmarks/simulator/stale_fit.py [--out DIR]

Deterministic: the same numbers on any machine (no wall clock anywhere).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkserve.benchlib.args import length_requests
from chunkserve.benchlib.metrics import compute_metrics
from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.benchlib.workloads import sample_lengths
from chunkserve.config import EngineConfig
from chunkserve.core.chunk_budget import StepObservation
from chunkserve.engine.clock import VirtualClock
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.processor import Processor
from chunkserve.engine.step_probe import run_probe
from chunkserve.sim.cost_executor import CostModelExecutor
from chunkserve.sim.cost_model import CostModel, LinearCostModel, ScaledCostModel, StepShape
from chunkserve.sim.online_model import OnlineCostModel
from chunkserve.sim.simulator import SimConfig, simulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.report import save_report  # noqa: E402

# SmolLM2-135M (Q4_1 GGUF, float32 activations) on a 2-core AMD EPYC Zen 3, AVX2 only: the
# start-up probe's fit, 2026-12-05 (seconds per unit of each cost_model.LINEAR_FEATURES term).
MACHINE = {"step": 3.29e-3, "request": 1.52e-4, "token": 6.74e-4, "small_gemm": 1.2e-4,
           "prefill_attention": 4.87e-7, "chunk_attention": 4.15e-7, "decode_context": 2.7e-6}
# The same model on the same host kind, with the C kernels of 2026-12-04 17:03.
OLDER_KERNELS = {"step": 1.03e-2, "token": 7.63e-4, "prefill_attention": 6.2e-7,
                 "chunk_attention": 9.43e-7, "sampled": 2.86e-4, "mixed": 3.26e-7}
TARGET_S = 0.250  # the default token-gap target (what `serve` runs with)
MAX_MODEL_LEN, NUM_KV_BLOCKS, CONCURRENCY = 8192, 8192, 16


@dataclass
class NoisyCostModel:
    """Another cost model's steps, each scaled by its own lognormal factor (sigma `noise`)."""

    base: CostModel
    noise: float
    seed: int

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        factor = float(np.exp(self._rng.normal(0.0, self.noise)))
        return {k: v * factor for k, v in self.base.breakdown(shape).items()}


def probe_on(machine: CostModel) -> list[StepObservation]:
    """engine/step_probe.py's probe, its steps timed by `machine` on a virtual clock."""
    config = EngineConfig.from_kwargs(max_model_len=MAX_MODEL_LEN, block_size=16)

    def make_engine(scratch: EngineConfig) -> LLMEngine:
        clock = VirtualClock()
        resolved = scratch.resolve(MAX_MODEL_LEN)
        executor = CostModelExecutor(machine, clock, resolved.cache_config.num_kv_blocks)
        return LLMEngine(resolved, executor, Processor(MAX_MODEL_LEN, vocab_size=None),
                         clock.time)

    return run_probe(make_engine, config.resolve(MAX_MODEL_LEN), vocab_size=49152)


def prediction_error(records: list[Any], first: int, last: int) -> float | None:
    """Median |predicted - measured| / measured of steps first..last (None: no prediction)."""
    errors = [abs(r.predicted_duration - r.duration) / r.duration
              for r in records[first:last + 1] if r.predicted_duration is not None]
    return float(np.median(errors)) if errors else None


def run(name: str, probe_machine: CostModel | None, seed: int) -> dict[str, Any]:
    machine = NoisyCostModel(LinearCostModel(MACHINE), 0.05, seed)
    input_lens, output_lens, _ = sample_lengths("mixed", 48, 0)
    requests = length_requests(input_lens, output_lens)
    point = SweepPoint(None, "decode-first", "adaptive", TARGET_S * 1e3)  # `auto`
    config = SimConfig(MAX_MODEL_LEN, NUM_KV_BLOCKS, max_num_seqs=CONCURRENCY)
    planner: Any = LinearCostModel(MACHINE)  # the oracle: the machine's own model, noiseless
    if probe_machine is not None:
        planner = OnlineCostModel()
        planner.fit_probe(probe_on(probe_machine))
    result = simulate(point, config, machine, requests, [0.0] * len(requests), planner)
    metrics = compute_metrics(result.results, result.duration, [50, 99])
    steps = result.records
    durations = np.array([r.duration for r in steps])
    over = durations > TARGET_S * 1.1
    return {
        "warm start": name, "req/s": len(requests) / result.duration,
        "ITL p50 (ms)": metrics["median_itl_ms"], "ITL p99 (ms)": metrics["p99_itl_ms"],
        "max step (ms)": 1e3 * float(durations.max()),
        "steps > 1.1x target": int(over.sum()),
        "steps 0-63: mean chunk": float(np.mean([r.num_prefill_tokens for r in steps[:64]])),
        "error, steps 0-15": prediction_error(steps, 0, 15),
        "error, steps 16-63": prediction_error(steps, 16, 63),
        "steps": len(steps),
    }


WARM_STARTS: list[tuple[str, CostModel | None]] = [
    ("oracle", None),
    ("fresh", LinearCostModel(MACHINE)),
    ("2x slow", ScaledCostModel(LinearCostModel(MACHINE), 2.0)),
    ("2x fast", ScaledCostModel(LinearCostModel(MACHINE), 0.5)),
    ("older kernels", LinearCostModel(OLDER_KERNELS)),
]


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder for stale_fit.{json,md}")
    p.add_argument("--seeds", type=int, default=5, help="noise seeds; medians are reported")
    args = p.parse_args()
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    rows = []
    for name, probe_machine in WARM_STARTS:
        runs = [run(name, probe_machine, seed) for seed in range(args.seeds)]
        row: dict[str, Any] = {"warm start": name}
        for key in runs[0]:
            if key != "warm start":
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = float(np.median(values)) if values else None
        rows.append(row)
    text = (f"Simulated capacity phase (mixed, 48 requests, {CONCURRENCY} at a time, target "
            f"{TARGET_S * 1e3:.0f} ms), medians of {args.seeds} noise seeds:\n\n" + table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        save_report(args.out, "stale_fit", rows, text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
