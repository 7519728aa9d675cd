"""`chunkserve sim` (the sweep, simulated) and `chunkserve profile` (calibration)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import replace
from typing import Any

from chunkserve.bench.sweep import parse_chunk_sizes, sweep_points
from chunkserve.bench.sweep_cli import (
    add_workload_args,
    check_fits,
    chunk_policy_extra,
    check_workload_args,
    sweep_and_report,
)
from chunkserve.bench.workloads import arrival_times, sample_lengths
from chunkserve.config import DTYPES
from chunkserve.sim.cost_model import (
    ATTENTION_BACKENDS,
    CostModel,
    LinearCostModel,
    RooflineCostModel,
)
from chunkserve.sim.simulator import SimConfig, length_requests, simulate
from chunkserve.sim.specs import get_hardware, get_model


def add_sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", required=True,
                   help="a GPU preset (a100-80gb, a100-40gb, h100-sxm, h200, l4, a6000) or a "
                        "profile file written by `chunkserve profile`")
    p.add_argument("--model", default="llama-3-8b",
                   help="a preset (llama-3-8b, llama-3-70b, llama-2-13b, mistral-7b, "
                        "smollm2-135m) or a HF config.json")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="fused",
                   help="fused: prefill+decode in one call (mixed-batch penalty); split: two "
                        "calls; pod: POD-Attention-style overlap")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--validate", action="store_true",
                   help="also run the real engine on the same workload (needs --hardware to be "
                        "a profile of this machine) and report the simulator's relative errors")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --validate: replay the workload with seeds seed..seed+N-1 and "
                        "take percentiles over all their requests")
    p.add_argument("--real-runs", nargs="+", default=None, metavar="FILE",
                   help="with --validate: score the simulator against real runs saved by "
                        "earlier --validate runs (their real_runs.json.gz; several files are "
                        "pooled) instead of running the engine; workload and chunk sizes come "
                        "from the files")
    add_workload_args(p)


def build_cost_model(args: argparse.Namespace) -> tuple[CostModel, int, int]:
    """(cost model, KV blocks, max_model_len) for --hardware/--model."""
    if os.path.isfile(args.hardware):
        from chunkserve.sim.calibrate import load_profile

        prof = load_profile(args.hardware)
        blocks = args.num_kv_blocks or prof["num_kv_blocks"]
        max_len = args.max_model_len or get_model(prof["model"]).max_position_embeddings
        return LinearCostModel(prof["coefficients"], prof["name"]), blocks, max_len
    hw, model = get_hardware(args.hardware), get_model(args.model)
    cost = RooflineCostModel(hw, model, args.tensor_parallel_size, args.attention_backend)
    blocks = args.num_kv_blocks or cost.kv_cache_blocks(args.block_size)
    return cost, blocks, args.max_model_len or model.max_position_embeddings


def run_sim(args: argparse.Namespace) -> int:
    check_workload_args(args)
    if args.validate:
        from chunkserve.sim.validate import run_validation

        return run_validation(args)
    if args.dataset_name == "file":
        raise ValueError("the simulator needs lengths only: use random, mixed or sharegpt-like")
    cost, blocks, max_len = build_cost_model(args)
    input_lens, output_lens, _ = sample_lengths(
        args.dataset_name, args.num_prompts, args.seed,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, long_fraction=args.mixed_long_fraction,
        long_input_range=args.mixed_long_input_range,
        short_input_range=args.mixed_short_input_range, output_range=args.mixed_output_range,
    )
    requests = length_requests(input_lens, output_lens)
    check_fits(requests, max_len)
    config = SimConfig(max_model_len=max_len, num_kv_blocks=blocks, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, chunk_policy=args.chunk_policy,
                       target_itl_ms=args.target_itl_ms, min_chunk_tokens=args.min_chunk_tokens)
    points = sweep_points(parse_chunk_sizes(args.chunk_sizes), args.scheduler, args.baseline)
    rate = args.request_rate
    if args.load is not None:
        rate = args.load * simulated_capacity(points, config, cost, requests)
        print(f"simulated capacity -> --load {args.load} = {rate:.3f} req/s")
    rate = float("inf") if rate is None else rate
    arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
    extra = {"request_rate": rate if rate != float("inf") else "inf",
             "num_prompts": len(requests), "dataset_name": args.dataset_name,
             "simulated": True, "hardware": args.hardware, "model": args.model,
             **chunk_policy_extra(args)}
    command = "chunkserve sim " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    title = (f"Simulated chunk-size sweep: {args.model} on {args.hardware}, {args.dataset_name}, "
             f"{len(requests)} requests")
    return sweep_and_report(
        points, lambda p: simulate(p, config, cost, requests, arrivals), extra, args, title,
        command,
    )


def simulated_capacity(points: list[Any], config: SimConfig, cost: CostModel,
                       requests: list[Any]) -> float:
    """Requests/s when everything arrives at once, at a 2048-token budget (vLLM's default)."""
    from chunkserve.bench.sweep import SweepPoint

    point = next((p for p in points if p.chunk_size != "none"), SweepPoint(2048, "decode-first"))
    # Static, so that static and adaptive sweeps of one workload get the same arrivals.
    static = replace(config, chunk_policy="static", target_itl_ms=None)
    run = simulate(SweepPoint(2048, point.scheduler), static, cost, requests, [0.0] * len(requests))
    return len(requests) / run.duration


# ---- profile ---------------------------------------------------------------------------------
def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a 4-scenario grid (tests, smoke runs)")
    p.add_argument("--output", "-o", default="profile.json")


def run_profile(args: argparse.Namespace) -> int:
    from chunkserve.sim.calibrate import profile, write_profile

    prof = profile(args.model, args.dtype, args.quick, args.block_size)
    write_profile(prof, args.output)
    print(f"{prof['num_samples']} steps timed in {prof['profile_seconds']} s; wrote {args.output}")
    for name, value in prof["coefficients"].items():
        print(f"  {name:<18} {value * 1e3:12.6f} ms per unit")
    print("fit error (mean relative):")
    for family, err in prof["fit_error"].items():
        print(f"  {family:<10} {err:6.1%}")
    return 0

