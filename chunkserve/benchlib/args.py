"""The workload and sweep flags, declared once for `bench serve`, `bench sweep` and `sim`.

Same names and LOW:HIGH syntax everywhere, so one workload reads the same in every command.
The defaults are shared too, except the two each command's users expect from its model:
`bench serve` follows `vllm bench serve` (random dataset, 1,000 prompts), the sweeps the
article (its mixed workload, 100 prompts).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chunkserve.benchlib.json_schemas import json_schema_requests
from chunkserve.benchlib.metrics import parse_goodput
from chunkserve.benchlib.shared_prefix import (
    add_shared_prefix_args,
    shared_prefix_requests,
    spec_from_args,
)
from chunkserve.benchlib.sweep import AUTO, SweepPoint, parse_chunk_sizes, sweep_points
from chunkserve.benchlib.workloads import (
    DATASET_NAMES,
    BenchRequest,
    BenchTokenizer,
    sample_lengths,
    sample_requests,
)
from chunkserve.config import CHUNKED_SCHEDULERS, NO_CHUNK_SCHEDULERS
from chunkserve.engine.arg_utils import add_chunk_policy_args
from chunkserve.engine.trace import TRACE_FORMATS


def int_pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return pair


def add_workload_args(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, dataset_name: str, num_prompts: int
) -> None:
    """The dataset, its lengths, the seed and the arrival process's shape."""
    p.add_argument("--dataset-name", choices=DATASET_NAMES, default=dataset_name)
    p.add_argument("--dataset-path", default=None, help="JSONL for --dataset-name file")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128,
                   help="output tokens (random, shared-prefix, file's default); json-schema: "
                        "the max_tokens cap")
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--mixed-long-fraction", type=float, default=0.1,
                   help="share of long prompts in the mixed workload")
    p.add_argument("--mixed-long-input-range", type=int_pair, default=(2048, 4096),
                   metavar="LOW:HIGH")
    p.add_argument("--mixed-short-input-range", type=int_pair, default=(32, 256),
                   metavar="LOW:HIGH")
    p.add_argument("--mixed-output-range", type=int_pair, default=(32, 128), metavar="LOW:HIGH")
    add_shared_prefix_args(p)
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 steadier")


def rate_list(text: str) -> tuple[float, ...]:
    """`0.7`, or `0.4,0.9`: one rate, or a rate that steps (see `add_rate_args`)."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got "
                                         f"{text!r}") from None
    return rates


def add_rate_args(p: argparse.ArgumentParser) -> None:
    """The arrival rate: absolute, or a fraction of the measured (or simulated) capacity.
    Several comma-separated values make a load that steps: the requests split into that many
    equal consecutive parts, each arriving at its own rate (workloads.stepped_arrival_times)."""
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=rate_list, default=None, metavar="RATE[,RATE...]",
                      help="req/s; inf = all at once; A,B: the first half at A, the second at B")
    rate.add_argument("--load", type=rate_list, default=None, metavar="FRACTION[,FRACTION...]",
                      help="arrival rate as a fraction of measured capacity (e.g. 0.7); "
                           "0.4,0.9: the first half of the requests at 0.4, the second at 0.9")


def check_rate_args(args: argparse.Namespace) -> None:
    for flag, rates in (("--request-rate", args.request_rate), ("--load", args.load)):
        if rates is not None and not all(r > 0 for r in rates):
            what = "a positive fraction of capacity" if flag == "--load" else "positive (req/s)"
            raise ValueError(f"{flag} must be {what}, got {','.join(f'{r:g}' for r in rates)}")


def request_rates(args: argparse.Namespace, capacity: Callable[[], float],
                  log: Callable[[str], None] = print) -> tuple[float, ...]:
    """The arrival rates (one per equal part of the workload): --request-rate, or --load
    times `capacity()` (measured only then: it runs the workload); neither: all at once."""
    if args.load is None:
        return args.request_rate or (math.inf,)
    cap = capacity()
    rates = tuple(load * cap for load in args.load)
    log(f"capacity {cap:.3f} req/s; --load {','.join(f'{x:g}' for x in args.load)} -> "
        f"{','.join(f'{r:.3f}' for r in rates)} req/s")
    return rates


def rate_json(rates: float | Sequence[float]) -> float | str | list[float | str]:
    """results.json's spelling of a rate or a load: a number ("inf": all at once), or a list
    for one that steps."""
    values: list[float | str] = [r if math.isfinite(r) else "inf"
                                 for r in ([rates] if isinstance(rates, float | int) else rates)]
    return values[0] if len(values) == 1 else values


def rate_keys(args: argparse.Namespace, rates: float | Sequence[float]) -> dict[str, Any]:
    """The results.json keys of the arrival process: the rate and, with --load, the load."""
    return {"request_rate": rate_json(rates),
            **({"load": rate_json(args.load)} if args.load is not None else {})}


def add_engine_shape_args(p: argparse.ArgumentParser) -> None:
    """The engine settings every configuration of a sweep (or a tune search) shares."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV of shared prefixes (vLLM V1: on)")


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    """What `bench sweep` and `sim` add to the workload: the configurations and the report."""
    add_workload_args(p, dataset_name="mixed", num_prompts=100)
    add_rate_args(p)
    p.add_argument("--chunk-sizes", default="none,32,64,128,256,512,1024,2048",
                   help="budgets to sweep; none: no chunking; auto: the adaptive policy as "
                        "`serve` runs it without flags (cap: the model's context; target: "
                        "--target-itl-ms or the default; the engine's own step-time model)")
    p.add_argument("--baseline", choices=NO_CHUNK_SCHEDULERS, default="prefill-first",
                   help="scheduler for the 'none' (no chunking) configuration")
    p.add_argument("--scheduler", choices=CHUNKED_SCHEDULERS, default="decode-first")
    add_engine_shape_args(p)
    p.add_argument("--percentiles", default="50,90,99", help="metric percentiles to report")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs like ttft:2000 tpot:100 e2el:20000")
    add_chunk_policy_args(p)  # adaptive: --chunk-sizes are the caps; 'none' stays static
    p.add_argument("--out", required=True, help="output folder for results.json, table.md, plots")
    p.add_argument("--trace-dir", default=None,
                   help="also write each configuration's step trace there "
                        "(steps-CHUNK.jsonl, the --trace-file format)")
    p.add_argument("--trace-format", choices=TRACE_FORMATS, default="jsonl",
                   help="--trace-dir's format: jsonl, or perfetto (steps-CHUNK.json, a "
                        "timeline for ui.perfetto.dev; labelled simulated from `sim`)")


def check_sweep_args(args: argparse.Namespace) -> None:
    """Fails on bad flags before anything slow (model loading, capacity probes) starts."""
    sizes = parse_chunk_sizes(args.chunk_sizes)
    parse_goodput(args.goodput)
    check_rate_args(args)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    # A target is read by adaptive points only: the sweep's caps, or its `auto` entries (which
    # run the default target without one, as `serve` does).
    if args.target_itl_ms is not None and args.chunk_policy != "adaptive" and AUTO not in sizes:
        raise ValueError("--target-itl-ms and --chunk-policy adaptive (or an 'auto' entry in "
                         "--chunk-sizes) go together")
    if args.target_itl_ms is not None and not args.target_itl_ms > 0:
        raise ValueError(f"--target-itl-ms must be positive, got {args.target_itl_ms}")


def points_from_args(args: argparse.Namespace) -> list[SweepPoint]:
    """The sweep's configurations: --chunk-sizes under --scheduler and the chunk policy."""
    return sweep_points(parse_chunk_sizes(args.chunk_sizes), args.scheduler, args.baseline,
                        args.chunk_policy, args.target_itl_ms, args.min_chunk_tokens)


def _length_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, long_fraction=args.mixed_long_fraction,
        long_input_range=args.mixed_long_input_range,
        short_input_range=args.mixed_short_input_range, output_range=args.mixed_output_range,
    )


def workload_requests(
    args: argparse.Namespace, tokenizer: BenchTokenizer, seed: int | None = None
) -> list[BenchRequest]:
    """The flags' workload as real prompts (`seed` overrides --seed: a validation repeat)."""
    seed = args.seed if seed is None else seed
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(spec_from_args(args), args.num_prompts, seed,
                                      args.random_output_len, tokenizer)
    if args.dataset_name == "json-schema":
        return json_schema_requests(tokenizer, args.num_prompts, seed, args.random_output_len)
    return sample_requests(args.dataset_name, tokenizer, args.num_prompts, seed,
                           dataset_path=args.dataset_path, **_length_kwargs(args))


def workload_lengths(args: argparse.Namespace) -> list[BenchRequest]:
    """The flags' workload as lengths only: all a simulation needs, and the same lengths as
    `workload_requests` draws for the seed. `shared-prefix` keeps token ids (made without a
    tokenizer): which prompts share blocks is what decides the simulated cache hits."""
    if args.dataset_name in ("file", "json-schema"):
        # json-schema: an output's length is where its JSON ends, which only a model decides.
        raise ValueError("the simulator needs lengths only: use random, mixed, sharegpt-like or "
                         "shared-prefix")
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(spec_from_args(args), args.num_prompts, args.seed,
                                      args.random_output_len)
    input_lens, output_lens, _ = sample_lengths(args.dataset_name, args.num_prompts, args.seed,
                                                **_length_kwargs(args))
    return length_requests(input_lens, output_lens)


# The simulator's placeholder prompt token: requests ignore EOS, so no id ever matters.
PLACEHOLDER_TOKEN = 0


def length_requests(
    input_lens: Sequence[int] | np.ndarray, output_lens: Sequence[int] | np.ndarray
) -> list[BenchRequest]:
    """Requests that carry lengths (and placeholder prompt tokens) only. Each prompt starts
    with its own index: placeholders alone would make every prompt share one prefix, and the
    prefix cache would skip what a real workload of unrelated prompts computes (block hashes
    chain, so a differing first token makes every block differ)."""
    return [BenchRequest("", [1 + k] + [PLACEHOLDER_TOKEN] * (int(i) - 1), int(i), int(o))
            for k, (i, o) in enumerate(zip(input_lens, output_lens))]


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    """Every request's prompt + output must fit the model's context, or the run cannot finish."""
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest > max_model_len:
        raise ValueError(f"the workload needs {longest} tokens per request, above max_model_len "
                         f"{max_model_len}")
