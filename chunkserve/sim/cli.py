"""`chunkserve sim`: the chunk-size sweep, simulated (and, with --validate, scored)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from chunkserve.benchlib.args import (
    add_sweep_args,
    check_fits,
    check_sweep_args,
    points_from_args,
    rate_keys,
    request_rates,
    workload_lengths,
)
from chunkserve.benchlib.report import sweep_and_report
from chunkserve.config import FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES
from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.benchlib.workloads import BenchRequest, stepped_arrival_times
from chunkserve.core.kv_groups import KVCacheGroups
from chunkserve.sim.cost_model import (
    ATTENTION_BACKENDS,
    CostModel,
    LinearCostModel,
    RooflineCostModel,
)
from chunkserve.sim.fit import load_profile, profile_attention_layers
from chunkserve.sim.simulator import SimConfig, Workbench, simulate
from chunkserve.sim.specs import get_hardware, get_model, profiled_kv_groups
from chunkserve.sim.validate import MeasureRealRuns, run_validation


def add_sim_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
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
    add_sweep_args(p)


def add_target_args(p: argparse.ArgumentParser) -> None:
    """What is simulated: the hardware (or this machine's profile) and the model on it."""
    p.add_argument("--hardware", required=True,
                   help="a GPU preset (a100-80gb, a100-40gb, h100-sxm, h200, l4, a6000) or a "
                        "profile file written by `chunkserve profile`")
    p.add_argument("--model", default="llama-3-8b",
                   help="a preset (llama-3-8b, llama-3-70b, llama-2-13b, mistral-7b, "
                        "smollm2-135m, gemma-3-270m, gemma-3-27b, ...) or a HF config.json")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="fused",
                   help="fused: prefill+decode in one call (mixed-batch penalty); split: two "
                        "calls; pod: POD-Attention-style overlap")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8*: one byte a K/V value (a preset's KV capacity doubles and its "
                        "decode attention reads half); bfloat16: two; auto: the model's dtype")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="as the engine's flag: one block table for all layers, so a "
                        "sliding-window model's local layers keep every block (its KV capacity "
                        "is a full-attention model's; attention still reads only the window)")


@dataclass(frozen=True)
class SimTarget:
    """What --hardware/--model simulate: the step cost, the KV pool and its groups."""

    cost: CostModel
    num_kv_blocks: int
    max_model_len: int
    # The model's KV-cache groups (sliding-window layers free blocks); None: one group.
    kv_cache_groups: KVCacheGroups | None = None


def build_cost_model(args: argparse.Namespace) -> tuple[CostModel, int, int]:
    """(cost model, KV blocks, max_model_len) for --hardware/--model."""
    target = build_target(args)
    return target.cost, target.num_kv_blocks, target.max_model_len


def build_target(args: argparse.Namespace) -> SimTarget:
    """The cost model, KV pool and KV-cache groups for --hardware/--model. A sliding-window
    model's groups size the pool (a block id is `group_size` layers, as the engine allocates
    it) and go to the simulated scheduler, which frees what leaves a window."""
    # Namespaces built by hand (tests, older callers) may lack the flag: the engine's default.
    hybrid = not getattr(args, "disable_hybrid_kv_cache_manager", False)
    if os.path.isfile(args.hardware):
        if args.kv_cache_dtype != "auto":
            raise ValueError("--kv-cache-dtype applies to hardware presets: a profile was "
                             "measured with its own engine's KV cache")
        prof = load_profile(args.hardware)
        blocks = args.num_kv_blocks or prof["num_kv_blocks"]
        max_len = args.max_model_len or get_model(prof["model"]).max_position_embeddings
        cost = LinearCostModel(prof["coefficients"], prof["name"],
                               profile_attention_layers(prof))
        groups = profiled_kv_groups(prof["model"], max_len) if hybrid else None
        return SimTarget(cost, blocks, max_len, groups)
    hw, model = get_hardware(args.hardware), get_model(args.model)
    if args.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        model = dataclasses.replace(model, kv_dtype_bytes=1)
    elif args.kv_cache_dtype == "bfloat16":
        model = dataclasses.replace(model, kv_dtype_bytes=2)
    cost = RooflineCostModel(hw, model, args.tensor_parallel_size, args.attention_backend)
    max_len = args.max_model_len or model.max_position_embeddings
    groups = model.kv_cache_groups(max_len) if hybrid else None
    blocks = args.num_kv_blocks or cost.kv_cache_blocks(args.block_size, groups)
    return SimTarget(cost, blocks, max_len, groups)


def run_sim(args: argparse.Namespace, measure_real_runs: MeasureRealRuns | None = None) -> int:
    """`measure_real_runs` runs the real engine for --validate; the command line passes it in
    (it lives with the benchmarks: the simulator never loads a model)."""
    check_sweep_args(args)
    if args.validate:
        return run_validation(args, measure_real_runs)
    # `auto` points are adaptive with the cap the model's context: the simulator's cost model
    # stands in for the engine's online fit (sim_engine plans with it), as for any adaptive one.
    points = points_from_args(args)
    chunked = any(not p.no_chunk for p in points)
    bench = sim_workbench(args, args.scheduler if chunked else "decode-first")
    extra = {**rate_keys(args, bench.rate), "num_prompts": len(bench.requests),
             "dataset_name": args.dataset_name, "simulated": True, "hardware": args.hardware,
             "model": args.model}
    command = "chunkserve sim " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    title = (f"Simulated chunk-size sweep: {args.model} on {args.hardware}, {args.dataset_name}, "
             f"{len(bench.requests)} requests")
    return sweep_and_report(points, bench.run, extra, args, title, command)


def sim_workbench(args: argparse.Namespace, scheduler: str = "decode-first",
                  log: Callable[[str], None] = print) -> Workbench:
    """The flags' workload, cost model and arrivals (--load: a fraction of the capacity
    simulated under `scheduler`; several: a load that steps), shared by `sim` and `tune`."""
    target = build_target(args)
    cost, max_len = target.cost, target.max_model_len
    requests = workload_lengths(args)
    check_fits(requests, max_len)
    config = SimConfig(max_model_len=max_len, num_kv_blocks=target.num_kv_blocks,
                       block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       enable_prefix_caching=args.enable_prefix_caching,
                       kv_cache_groups=target.kv_cache_groups)
    rates = request_rates(args, lambda: simulated_capacity(scheduler, config, cost, requests),
                          log=lambda line: log(f"simulated {line}"))
    arrivals = stepped_arrival_times(len(requests), rates, args.burstiness, args.seed)
    return Workbench(config, cost, requests, arrivals, rates[0] if len(rates) == 1 else rates)


def simulated_capacity(scheduler: str, config: SimConfig, cost: CostModel,
                       requests: list[BenchRequest]) -> float:
    """Requests/s when everything arrives at once, at a 2048-token budget (vLLM's default)."""
    run = simulate(SweepPoint(2048, scheduler), config, cost, requests, [0.0] * len(requests))
    return len(requests) / run.duration
