"""`chunkserve sim --validate`'s real half: the workloads replayed through the real engine.

The scoring (the simulator against these runs) is the simulator's (sim/validate.py); the
command line hands `measure_real_runs` to it, so the simulator never loads a model.
"""
from __future__ import annotations

import argparse
from typing import Any

from chunkserve.bench.calibration import load_profiled_model, step_sample
from chunkserve.bench.sweep import run_point
from chunkserve.benchlib.args import check_fits, workload_requests
from chunkserve.benchlib.sweep import parse_chunk_sizes, sweep_points
from chunkserve.benchlib.workloads import stepped_arrival_times
from chunkserve.engine.llm_engine import StepResult
from chunkserve.model.factory import LoadedModel
from chunkserve.sim.cost_model import StepShape
from chunkserve.sim.validate import RealRun


def measure_real_runs(
    args: argparse.Namespace, profile: dict[str, Any]
) -> tuple[list[RealRun], dict[str, Any]]:
    """The real runs of --validate and the engine configuration they share (what the
    simulator must be given to replay them), on the profile's model and weights format."""
    loaded = load_profiled_model(profile, args.max_model_len)
    runs = replay_workloads(args, loaded)
    meta = {"model": profile["model"], "max_model_len": loaded.max_model_len,
            "num_kv_blocks": args.num_kv_blocks or profile["num_kv_blocks"],
            "block_size": args.block_size, "max_num_seqs": args.max_num_seqs}
    return runs, meta


def replay_workloads(args: argparse.Namespace, loaded: LoadedModel) -> list[RealRun]:
    """Replays the workloads of seeds seed..seed+repeats-1 through the real engine, every
    configuration within a repeat before the next repeat (a slow spell of the machine then
    hits all configurations alike)."""
    engine_kwargs: dict[str, Any] = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                         num_kv_blocks=args.num_kv_blocks)
    points = sweep_points(parse_chunk_sizes(args.chunk_sizes), args.scheduler, args.baseline)
    runs: list[RealRun] = []
    for rep in range(args.repeats):
        seed = args.seed + rep
        requests = workload_requests(args, loaded.tokenizer, seed)
        check_fits(requests, loaded.max_model_len)
        arrivals = stepped_arrival_times(len(requests), args.request_rate, args.burstiness,
                                         seed)
        for point in points:
            steps: list[tuple[StepShape, float]] = []

            def on_step(step: StepResult, steps: list[tuple[StepShape, float]] = steps) -> None:
                sample = step_sample(step)
                if sample is not None:
                    steps.append(sample)

            real = run_point(loaded, point, requests, arrivals, engine_kwargs, on_step=on_step)
            runs.append(RealRun(point, seed, [r.prompt_len for r in requests],
                                [r.output_len for r in requests], list(arrivals),
                                real.results, real.duration, steps))
            print(f"repeat {rep + 1}/{args.repeats} chunk_size={point.label!s:>5}: "
                  f"{len(requests)} requests in {real.duration:.1f} s", flush=True)
    return runs
