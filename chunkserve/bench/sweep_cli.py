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
    workload_requests,
)
from chunkserve.benchlib.report import sweep_and_report
from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.benchlib.workloads import arrival_times
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
        **step_time_kwargs(args.chunk_policy, args.cost_model, args.model),
    )
    rate = args.request_rate
    if args.load is not None:
        probe = SweepPoint(512, args.scheduler)
        capacity = measure_capacity(loaded, requests, engine_kwargs, probe)
        rate = args.load * capacity
        print(f"measured capacity {capacity:.3f} req/s; --load {args.load} -> {rate:.3f} req/s")
    rate = float("inf") if rate is None else rate
    arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
    extra = {"request_rate": rate if rate != float("inf") else "inf",
             "num_prompts": len(requests), "dataset_name": args.dataset_name}
    command = "chunkserve bench sweep " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    title = f"Chunk-size sweep: {args.model}, {args.dataset_name}, {len(requests)} requests"
    return sweep_and_report(
        points, lambda p: run_point(loaded, p, requests, arrivals, engine_kwargs), extra, args,
        title, command,
    )
