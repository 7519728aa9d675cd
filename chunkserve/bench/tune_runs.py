"""`chunkserve tune --verify`'s real half: chosen configurations replayed on the real engine.

The comparison is tune's (tune/verify.py); the command line hands `measure_tune_runs` to it, so
tune, like the simulator, never loads a model.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from chunkserve.bench.calibration import load_profiled_model
from chunkserve.bench.sweep import run_point
from chunkserve.benchlib.args import check_fits, workload_requests
from chunkserve.benchlib.sweep import RunResult, SweepPoint
from chunkserve.model.factory import load_model
from chunkserve.sim.fit import load_profile
from chunkserve.sim.step_cost import engine_step_time

WARMUP_REQUESTS = 8


def measure_tune_runs(args: argparse.Namespace, points: list[SweepPoint],
                      arrivals: Sequence[float], num_kv_blocks: int) -> list[RunResult]:
    """One real run per configuration, on the simulated workload's prompts (same lengths, same
    seed), arrivals and KV pool; on the profile's model and weights format when --hardware is
    one."""
    model = args.model
    if os.path.isfile(args.hardware):
        prof = load_profile(args.hardware)
        model = prof.get("model", model)
        loaded = load_profiled_model({**prof, "model": model}, args.max_model_len)
    else:
        loaded = load_model(model, "auto", args.max_model_len)
    requests = workload_requests(args, loaded.tokenizer)
    check_fits(requests, loaded.max_model_len)
    engine_kwargs: dict[str, Any] = dict(
        block_size=args.block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    if any(p.adaptive for p in points):  # the policy plans with the cost model tune used
        engine_kwargs["step_time"] = engine_step_time(args.hardware, model)
    # An untimed pass first: a process's first run pays one-time costs (oneDNN builds a kernel
    # for each new GEMM shape, the KV pool's pages are first touched) and would charge them to
    # whichever configuration comes first, which is the pick.
    warm = list(requests[:WARMUP_REQUESTS])
    if points:
        run_point(loaded, points[0], warm, [0.0] * len(warm), engine_kwargs)
    runs = []
    for point in points:
        run = run_point(loaded, point, requests, arrivals, engine_kwargs)
        print(f"verify {point.scheduler} {point.label}: {len(requests)} requests in "
              f"{run.duration:.1f} s", file=sys.stderr, flush=True)  # stdout may be --json
        runs.append(run)
    return runs
