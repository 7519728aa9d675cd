"""`chunkserve tune`: which chunking configuration for this model, hardware, workload and SLOs.

The workload flags are `sim`'s and `bench sweep`'s (benchlib/args.py), the hardware and model
flags `sim`'s; the search runs on the simulator (tune/search.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from chunkserve.benchlib.args import (
    add_engine_shape_args,
    add_rate_args,
    add_workload_args,
    check_rate_args,
    rate_keys,
)
from chunkserve.benchlib.sweep import parse_chunk_sizes
from chunkserve.config import NO_CHUNK_SCHEDULERS
from chunkserve.sim.cli import add_target_args, sim_workbench
from chunkserve.tune.auto import auto_dict, evaluate_auto
from chunkserve.tune.flags import chunkserve_line, vllm_line
from chunkserve.tune.report import format_text, tune_dict
from chunkserve.sim.simulator import Workbench
from chunkserve.tune.search import PROFILE_SPEED_MARGIN, Evaluated, TuneResult, search
from chunkserve.tune.slo import OBJECTIVES, parse_slos
from chunkserve.tune.space import DEFAULT_BUDGETS, SearchSpace, neighbours
from chunkserve.tune.verify import MeasureRuns, format_verify, verify, verify_points
from chunkserve.tune.why import explain

DEFAULT_LOAD = 0.7


def add_tune_args(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    add_workload_args(p, dataset_name="mixed", num_prompts=200)
    add_rate_args(p)
    add_engine_shape_args(p)
    p.add_argument("--slo", action="append", default=None, metavar="KEY:MS",
                   help="an SLO, repeatable: ttft_p99:MS, itl_p99:MS, tpot_p99:MS (also p50, "
                        "p90, and e2el)")
    p.add_argument("--objective", choices=OBJECTIVES, default="goodput",
                   help="what to maximise among configurations that meet the SLOs "
                        "(ttft: the lowest TTFT p99)")
    p.add_argument("--chunk-sizes", default=",".join(map(str, DEFAULT_BUDGETS)),
                   help="the static budgets to try (the no-chunk baseline is always tried, and "
                        "auto, the default policy, is always compared with the pick)")
    p.add_argument("--baseline", choices=NO_CHUNK_SCHEDULERS, default="prefill-first",
                   help="scheduler of the no-chunk baseline")
    p.add_argument("--speed-margin", type=float, default=None, metavar="X",
                   help="also simulate every configuration on a machine X times slower than "
                        "--hardware says, and hold it to the SLOs and the objective there too "
                        f"(1: no margin; default {PROFILE_SPEED_MARGIN} with a profile file, "
                        "whose machine may drift, 1 with a hardware preset)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.add_argument("--verify", action="store_true",
                   help="replay the pick and its two neighbours on the real engine (--hardware "
                        "should then be a profile of this machine) and report predicted vs "
                        "measured")


def check_tune_args(args: argparse.Namespace) -> tuple[dict[str, float], SearchSpace]:
    """Fails on bad flags before anything is simulated."""
    slos = parse_slos(args.slo)
    budgets = parse_chunk_sizes(args.chunk_sizes)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.speed_margin is None:
        args.speed_margin = PROFILE_SPEED_MARGIN if os.path.isfile(args.hardware) else 1.0
    if not args.speed_margin >= 1.0:
        raise ValueError(f"--speed-margin must be at least 1 (1: no margin), got "
                         f"{args.speed_margin}")
    check_rate_args(args)
    if args.request_rate is None and args.load is None:
        args.load = (DEFAULT_LOAD,)  # a rate matters: all-at-once would rank TTFT by queue place
    # 'none' and 'auto' are no rungs of the ladder: the baseline and auto are always run.
    return slos, SearchSpace(budgets=tuple(b for b in budgets if isinstance(b, int)),
                             baseline=args.baseline)


def answer(args: argparse.Namespace, result: TuneResult, bench: Workbench,
           slos: dict[str, float]) -> tuple[dict[str, Any], list[Evaluated]]:
    """The answer, and the configurations --verify would replay."""
    pick = result.pick
    below, above = (next((e for e in result.ladder if e.point == p), None)
                    for p in neighbours(pick.point, pick.budget, [e.point for e in result.ladder]))
    prompt_lens = {f"r{i}": r.prompt_len for i, r in enumerate(bench.requests)}
    vllm, note = vllm_line(pick.point, pick.budget, args.model, bench.config.max_model_len,
                           args.max_num_seqs)
    lines = {"chunkserve": chunkserve_line(pick.point, args.model, args.hardware,
                                           args.max_num_seqs), "vllm": vllm, "vllm_note": note}
    d = tune_dict(result, slos, args.objective, explain(pick, below, above, slos, prompt_lens),
                  lines, args.speed_margin)
    auto = evaluate_auto(bench, slos, args.speed_margin)
    d["auto"] = auto_dict(auto, pick, slos, args.objective,
                          chunkserve_line(auto.point, args.model, args.hardware, args.max_num_seqs))
    d["workload"] = {"dataset_name": args.dataset_name, "num_prompts": len(bench.requests),
                     **rate_keys(args, bench.rate), "hardware": args.hardware,
                     "model": args.model}
    return d, verify_points(pick, below, above, result.ranked)


def run_tune(args: argparse.Namespace, measure: MeasureRuns | None = None) -> int:
    """`measure` makes the real runs of --verify; the command line passes it in."""
    slos, space = check_tune_args(args)
    if args.verify and measure is None:
        raise ValueError("--verify needs the real engine")
    bench = sim_workbench(args, log=lambda line: print(line, file=sys.stderr))  # stdout: answer
    result = search(bench, space, slos, args.objective, args.speed_margin)
    d, evals = answer(args, result, bench, slos)
    if args.verify:
        assert measure is not None
        d["verify"] = verify(args, evals, bench, slos, measure)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(format_text(d) + (format_verify(d["verify"]) if args.verify else ""))
    return 0
