"""`chunkserve bench sweep` flags and driver: workload → every chunk size → report."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from chunkserve.bench.sweep import measure_capacity, run_point
from chunkserve.benchlib.args import (
    add_sweep_args,
    check_fits,
    check_sweep_args,
    points_from_args,
    rate_keys,
    request_rates,
    workload_requests,
)
from chunkserve.benchlib.report import sweep_and_report
from chunkserve.benchlib.sweep import RunResult, SweepPoint
from chunkserve.benchlib.workloads import stepped_arrival_times
from chunkserve.config import ATTENTION_BACKENDS, DEVICES, DTYPES, LOAD_FORMATS
from chunkserve.engine.arg_utils import add_cost_model_arg
from chunkserve.sim.step_cost import step_time_kwargs


def add_bench_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="as for serve; a preset (llama-3-8b, ...) runs with random weights")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB (default 2)")
    add_cost_model_arg(p)
    add_sweep_args(p)


def run_sweep(args: argparse.Namespace) -> int:
    from chunkserve.model.factory import load_model

    check_sweep_args(args)
    points = points_from_args(args)
    loaded = load_model(
        args.model, args.dtype, args.max_model_len, args.device, load_format=args.load_format,
        attention_backend=args.attention_backend, seed=args.seed,
    )
    requests = workload_requests(args, loaded.tokenizer)
    check_fits(requests, loaded.max_model_len)
    engine_kwargs: dict[str, Any] = dict(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
    )
    probe = SweepPoint(512, args.scheduler)
    rates = request_rates(args, lambda: measure_capacity(loaded, requests, engine_kwargs, probe),
                          log=lambda line: print(f"measured {line}"))
    arrivals = stepped_arrival_times(len(requests), rates, args.burstiness, args.seed)
    extra = {**rate_keys(args, rates), "num_prompts": len(requests),
             "dataset_name": args.dataset_name}
    command = "chunkserve bench sweep " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    title = f"Chunk-size sweep: {args.model}, {args.dataset_name}, {len(requests)} requests"

    def run_one(point: SweepPoint) -> RunResult:
        # Each adaptive point's own step-time model: an online one learns from its run only.
        # auto's is always the online model, which run_point makes.
        policy = None if point.auto else point.chunk_policy
        kwargs = {**engine_kwargs, **step_time_kwargs(policy, args.cost_model, args.model)}
        return run_point(loaded, point, requests, arrivals, kwargs)

    return sweep_and_report(points, run_one, extra, args, title, command)
