"""`chunkserve bench sweep` flags and driver: workload → every chunk size → report."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from chunkserve.bench.report import plot_all, table_markdown, write_results, write_table
from chunkserve.bench.sweep import (
    RunResult,
    SweepPoint,
    measure_capacity,
    parse_chunk_sizes,
    run_point,
    summarize,
    sweep_points,
)
from chunkserve.bench.serve_bench import int_pair
from chunkserve.bench.workloads import arrival_times, sample_requests
from chunkserve.config import (
    ATTENTION_BACKENDS,
    CHUNKED_SCHEDULERS,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    NO_CHUNK_SCHEDULERS,
)
from chunkserve.engine.arg_utils import add_chunk_policy_args
from chunkserve.engine.trace import write_trace


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags `bench sweep` shares with the simulator (same names as bench serve)."""
    p.add_argument("--dataset-name", default="mixed", choices=["random", "mixed", "sharegpt-like", "file"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--mixed-long-fraction", type=float, default=0.1)
    # Same names and LOW:HIGH syntax as `bench serve`, so one workload reads the same everywhere.
    p.add_argument("--mixed-long-input-range", type=int_pair, default=(2048, 4096),
                   metavar="LOW:HIGH")
    p.add_argument("--mixed-short-input-range", type=int_pair, default=(32, 256),
                   metavar="LOW:HIGH")
    p.add_argument("--mixed-output-range", type=int_pair, default=(32, 128), metavar="LOW:HIGH")
    p.add_argument("--seed", type=int, default=0)
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, default=None, help="req/s; inf = all at once")
    rate.add_argument("--load", type=float, default=None,
                      help="arrival rate as a fraction of measured capacity (e.g. 0.7)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--chunk-sizes", default="none,32,64,128,256,512,1024,2048")
    p.add_argument("--baseline", choices=NO_CHUNK_SCHEDULERS, default="prefill-first",
                   help="scheduler for the 'none' (no chunking) configuration")
    p.add_argument("--scheduler", choices=CHUNKED_SCHEDULERS, default="decode-first")
    add_chunk_policy_args(p)  # adaptive: --chunk-sizes are the caps; 'none' stays static
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--percentiles", default="50,90,99", help="metric percentiles to report")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs like ttft:2000 tpot:100 e2el:20000")
    p.add_argument("--out", required=True, help="output folder for results.json, table.md, plots")
    p.add_argument("--trace-dir", default=None,
                   help="also write each configuration's step trace there "
                        "(steps-CHUNK.jsonl, the --trace-file format)")


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="as for serve; a preset (llama-3-8b, ...) runs with random weights")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB (default 2)")
    p.add_argument("--cost-model", default=None,
                   help="--chunk-policy adaptive: a `chunkserve profile` file or a hardware "
                        "preset; default: the cached profile of this machine")
    add_workload_args(p)


def check_workload_args(args: argparse.Namespace) -> None:
    """Fails on bad flags before anything slow (model loading, capacity probes) starts."""
    parse_chunk_sizes(args.chunk_sizes)
    parse_goodput(args.goodput)
    if args.load is not None and not args.load > 0:
        raise ValueError(f"--load must be a positive fraction of capacity, got {args.load}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if (args.chunk_policy == "adaptive") != (args.target_itl_ms is not None):
        raise ValueError("--chunk-policy adaptive and --target-itl-ms go together")
    if args.target_itl_ms is not None and not args.target_itl_ms > 0:
        raise ValueError(f"--target-itl-ms must be positive, got {args.target_itl_ms}")


def chunk_policy_extra(args: argparse.Namespace) -> dict[str, Any]:
    """results.json keys for an adaptive run (none for a static one: its keys stay as they were)."""
    if args.chunk_policy == "static":
        return {}
    return {"chunk_policy": args.chunk_policy, "target_itl_ms": args.target_itl_ms,
            "min_chunk_tokens": args.min_chunk_tokens}


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def workload_from_args(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    return sample_requests(
        args.dataset_name, tokenizer, args.num_prompts, args.seed,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, long_fraction=args.mixed_long_fraction,
        long_input_range=args.mixed_long_input_range,
        short_input_range=args.mixed_short_input_range, output_range=args.mixed_output_range,
        dataset_path=args.dataset_path,
    )


def check_fits(requests: Sequence[Any], max_model_len: int) -> None:
    """Every request's prompt + output must fit the model's context, or the run cannot finish."""
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest > max_model_len:
        raise ValueError(f"the workload needs {longest} tokens per request, above max_model_len "
                         f"{max_model_len}")


def run_sweep(args: argparse.Namespace) -> int:
    from chunkserve.model.factory import load_model

    check_workload_args(args)
    sizes = parse_chunk_sizes(args.chunk_sizes)
    points = sweep_points(sizes, args.scheduler, args.baseline)
    loaded = load_model(
        args.model, args.dtype, args.max_model_len, args.device, load_format=args.load_format,
        attention_backend=args.attention_backend, seed=args.seed,
    )
    requests = workload_from_args(args, loaded.tokenizer)
    check_fits(requests, loaded.max_model_len)
    engine_kwargs: dict[str, Any] = dict(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager, chunk_policy=args.chunk_policy,
        target_itl_ms=args.target_itl_ms, min_chunk_tokens=args.min_chunk_tokens,
        cost_model=args.cost_model,
    )
    rate = args.request_rate
    if args.load is not None:
        probe = SweepPoint(512, args.scheduler)
        # Static, so that static and adaptive sweeps of one workload get the same arrivals.
        static = {**engine_kwargs, "chunk_policy": "static", "target_itl_ms": None}
        capacity = measure_capacity(loaded, requests, static, probe)
        rate = args.load * capacity
        print(f"measured capacity {capacity:.3f} req/s; --load {args.load} -> {rate:.3f} req/s")
    rate = float("inf") if rate is None else rate
    arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
    extra = {"request_rate": rate if rate != float("inf") else "inf",
             "num_prompts": len(requests), "dataset_name": args.dataset_name,
             **chunk_policy_extra(args)}
    command = "chunkserve bench sweep " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    title = f"Chunk-size sweep: {args.model}, {args.dataset_name}, {len(requests)} requests"
    return sweep_and_report(
        points, lambda p: run_point(loaded, p, requests, arrivals, engine_kwargs), extra, args,
        title, command,
    )


def sweep_and_report(
    points: list[SweepPoint],
    run_one: Callable[[SweepPoint], RunResult],
    extra: dict[str, Any],
    args: argparse.Namespace,
    title: str,
    command: str,
) -> int:
    """Runs every configuration, then writes results.json, table.md and the plots to --out.

    Shared by the real sweep and the simulator so that both report in one format.
    """
    percentiles = [float(p) for p in args.percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    os.makedirs(args.out, exist_ok=True)
    entries: list[dict[str, Any]] = []
    runs: list[RunResult] = []
    for point in points:
        t0 = time.monotonic()
        run = run_one(point)
        run.extra = dict(extra)
        entry = summarize(run, percentiles, goodput)
        entries.append(entry)
        runs.append(run)
        print(
            f"chunk_size={point.chunk_size!s:>5} {point.scheduler:<13} "
            f"TTFT p50 {entry['median_ttft_ms']:8.0f} ms  TPOT p99 {entry['p99_tpot_ms']:7.1f} ms  "
            f"ITL p99 {entry['p99_itl_ms']:7.1f} ms  max gap {entry['max_itl_ms']:7.0f} ms  "
            f"({time.monotonic() - t0:.1f} s)",
            flush=True,
        )
        write_results(args.out, entries)  # after every point: a long sweep keeps what it did
        if getattr(args, "trace_dir", None):
            os.makedirs(args.trace_dir, exist_ok=True)
            write_trace(os.path.join(args.trace_dir, f"steps-{point.chunk_size}.jsonl"),
                        run.records)
    write_table(args.out, entries, title, command)
    plot_all(args.out, entries, runs)
    print(table_markdown(entries, title, command))
    return 0
