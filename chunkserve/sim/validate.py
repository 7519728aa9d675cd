"""`chunkserve sim --validate`: the real engine and the calibrated simulator, same workload.

Both replay the same requests at the same arrival offsets for each chunk size; the report is
the simulator's relative error on the numbers a user would tune by.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from chunkserve.bench.sweep import parse_chunk_sizes, run_point, summarize, sweep_points
from chunkserve.bench.sweep_cli import parse_goodput, workload_from_args
from chunkserve.bench.workloads import arrival_times
from chunkserve.sim.simulator import SimConfig, length_requests, simulate

COMPARED = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms",
            "output_throughput")


def relative_errors(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    return {k: (sim[k] - real[k]) / real[k] for k in COMPARED if real.get(k)}


def run_validation(args: argparse.Namespace) -> int:
    from chunkserve.model.factory import load_model
    from chunkserve.sim.calibrate import load_profile
    from chunkserve.sim.cli import build_cost_model

    if not os.path.isfile(args.hardware):
        raise ValueError("--validate compares against this machine: --hardware must be a "
                         "profile file written here by `chunkserve profile`")
    prof = load_profile(args.hardware)
    cost, _, _ = build_cost_model(args)
    loaded = load_model(prof["model"], prof["dtype"], args.max_model_len)
    requests = workload_from_args(args, loaded.tokenizer)
    if args.request_rate is None:
        raise ValueError("--validate needs an explicit --request-rate (the same for both runs)")
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    engine_kwargs: dict[str, Any] = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                         num_kv_blocks=args.num_kv_blocks)
    blocks = args.num_kv_blocks or prof["num_kv_blocks"]
    config = SimConfig(loaded.max_model_len, blocks, args.block_size, args.max_num_seqs)
    sim_requests = length_requests([r.prompt_len for r in requests],
                                   [r.output_len for r in requests])
    percentiles = [float(p) for p in args.percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    rows = []
    for point in sweep_points(parse_chunk_sizes(args.chunk_sizes), args.scheduler, args.baseline):
        real = summarize(run_point(loaded, point, requests, arrivals, engine_kwargs),
                         percentiles, goodput)
        sim = summarize(simulate(point, config, cost, sim_requests, arrivals), percentiles, goodput)
        errors = relative_errors(real, sim)
        rows.append({"chunk_size": point.chunk_size, "scheduler": point.scheduler,
                     "real": {k: real[k] for k in COMPARED}, "sim": {k: sim[k] for k in COMPARED},
                     "relative_error": errors})
        print(f"chunk_size={point.chunk_size!s:>5}: " + "  ".join(
            f"{k} {v:+.1%}" for k, v in errors.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write(validation_markdown(rows))
    print(validation_markdown(rows))
    return 0


def validation_markdown(rows: list[dict[str, Any]]) -> str:
    head = "| chunk_size | " + " | ".join(COMPARED) + " |"
    lines = ["Simulator relative error vs the real engine (sim − real) / real; real value in "
             "parentheses.", "", head, "|" + "---|" * (len(COMPARED) + 1)]
    for r in rows:
        cells = []
        for k in COMPARED:
            err = r["relative_error"].get(k)
            cells.append("–" if err is None else f"{err:+.1%} ({r['real'][k]:,.1f})")
        lines.append(f"| {r['chunk_size']} | " + " | ".join(cells) + " |")
    worst = max((abs(v) for r in rows for v in r["relative_error"].values()), default=0.0)
    lines += ["", f"Largest absolute error: {worst:.1%}.", ""]
    return "\n".join(lines)
