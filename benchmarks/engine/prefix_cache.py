"""Prefix caching on vs off, real engine in process (docs/performance.md, issue 15).

Two workloads, each run with caching on and off, interleaved (on, off, on, off, ...) so that
machine noise hits both alike; medians over the repeats, ratios taken within each pair:

- multi-turn chat: `shared-prefix` with one 1,000-token system prompt shared by every
  conversation, each turn resending the history. Same requests, arrivals and output tokens
  for both settings. Reports TTFT p50, prefill tokens computed (from the step trace) and the
  measured hit rate.
- no shared prefix: `random` prompts, all arriving at once; reports the wall time of the whole
  run and the summed step times (the cost of hashing and bookkeeping when nothing ever hits).

    chrt -i 0 nice -n 19 .venv/bin/python benchmarks/engine/prefix_cache.py --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import numpy as np

from chunkserve.benchlib.shared_prefix import SharedPrefixSpec, shared_prefix_requests
from chunkserve.bench.sweep import SweepPoint, run_point
from chunkserve.benchlib.workloads import arrival_times, sample_requests
from chunkserve.model.factory import load_model

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402


def one_run(loaded: Any, requests: list, arrivals: list[float], caching: bool,
            budget: int) -> dict[str, float]:
    run = run_point(loaded, SweepPoint(budget, "decode-first"), requests, arrivals,
                    dict(enable_prefix_caching=caching))
    ttfts = [r.ttft for r in run.results]
    prefill = sum(r.num_prefill_tokens for r in run.records)
    queries = sum(r.prefix_cache_queries for r in run.records)
    hits = sum(r.prefix_cache_hits for r in run.records)
    return {"ttft_p50_ms": 1000 * float(np.median(ttfts)), "duration_s": run.duration,
            "busy_s": sum(r.duration for r in run.records), "prefill_tokens": prefill, "hit_rate": hits / queries if queries else 0.0,
            "output_tokens": sum(r.output_len for r in run.results)}


def compare(name: str, loaded: Any, requests: list, arrivals: list[float], repeats: int,
            budget: int) -> dict[str, Any]:
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(repeats):
        # Alternate which setting goes first, so drift within a pair favours neither.
        for caching in ((True, False) if r % 2 == 0 else (False, True)):
            runs[caching].append(one_run(loaded, requests, arrivals, caching, budget))
            print(name, "on " if caching else "off", runs[caching][-1], flush=True)
    on, off = runs[True], runs[False]
    med = {k: {key: statistics.median(r[key] for r in v) for key in v[0]}
           for k, v in (("on", on), ("off", off))}
    ttft_ratio = statistics.median(b["ttft_p50_ms"] / a["ttft_p50_ms"] for a, b in zip(on, off))
    time_ratio = statistics.median(a["duration_s"] / b["duration_s"] for a, b in zip(on, off))
    busy_ratio = statistics.median(a["busy_s"] / b["busy_s"] for a, b in zip(on, off))
    return {"workload": name, "median": med, "ttft_p50_off_over_on": ttft_ratio,
            "duration_on_over_off": time_ratio, "busy_on_over_off": busy_ratio,
            "prefill_tokens_on_over_off": med["on"]["prefill_tokens"] / med["off"]["prefill_tokens"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--chat-prompts", type=int, default=12)
    # Low enough that the no-cache run is not saturated: the ratio is then prefill, not queueing.
    p.add_argument("--chat-rate", type=float, default=0.2, help="requests/s")
    p.add_argument("--chat-turns", type=int, default=3)
    p.add_argument("--random-prompts", type=int, default=12)
    p.add_argument("--output", default=None, help="write the summary as JSON here")
    p.add_argument("--workloads", default="multi-turn-chat,no-shared-prefix",
                   help="comma-separated subset to run")
    args = p.parse_args()

    loaded = load_model(args.model, "auto", None, "auto")
    spec = SharedPrefixSpec(num_groups=1, prefix_len=1000, suffix_len=48,
                            num_turns=args.chat_turns)
    chat = shared_prefix_requests(spec, args.chat_prompts, 0, 32, loaded.tokenizer)
    chat_arrivals = arrival_times(len(chat), args.chat_rate, 1.0, 0)
    rand = sample_requests("random", loaded.tokenizer, args.random_prompts, 0,
                           random_input_len=256, random_output_len=32)
    rand_arrivals = [0.0] * len(rand)
    # Warm-up: first-call costs (allocator, kernels) must not land on one setting.
    run_point(loaded, SweepPoint(args.budget, "decode-first"), rand[:4], [0.0] * 4, {})

    summary = {"cpu": cpu_model(), "model": args.model, "budget": args.budget,
               "repeats": args.repeats,
               "results": [compare(name, loaded, reqs, arrivals, args.repeats, args.budget)
                           for name, reqs, arrivals in (
                               ("multi-turn-chat", chat, chat_arrivals),
                               ("no-shared-prefix", rand, rand_arrivals))
                           if name in args.workloads.split(",")]}
    print(json.dumps(summary, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
