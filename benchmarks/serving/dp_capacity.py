"""Served capacity of `serve --data-parallel-size 2` against one engine, on this machine.

One engine uses every core; two engines get half the cores each (frontend/engines.py). Each
configuration is started fresh for every measurement, alternating (dp1, dp2, dp1, dp2, ...) so
that drift on a shared machine hits both alike, and `chunkserve bench serve` drives it with the
article's mixed workload in a closed loop (--max-concurrency 16, all requests queued at once),
as compare_llama_server.py's capacity phase. Medians over --repeats are reported, with the
ratio dp2 / dp1 of each metric.

    .venv/bin/python benchmarks/serving/dp_capacity.py --out docs/results/dp-cpu [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info  # noqa: E402
from benchmarks.common.report import save_report  # noqa: E402
from benchmarks.serving.served import (  # noqa: E402
    CLOSED_LOOP,
    ROWS,
    failed_count,
    free_port,
    measure_server,
)

CONFIGS = {"dp1": [], "dp2": ["--data-parallel-size", "2"]}


def measure(name: str, extra: list[str], out_dir: str, run: int, num_prompts: int,
            model: str) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "chunkserve.cli", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *extra]
    result = measure_server(name, cmd, port, out_dir, f"run{run}", CLOSED_LOOP, num_prompts,
                            model)
    result["server_command"] = " ".join(cmd[1:])
    result["failed"] = failed_count(result)
    return result


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| metric (median of runs) | one engine | two engines (-dp 2) | dp2 / dp1 |",
             "|---|---:|---:|---:|"]
    for label, key, _ in ROWS:
        a, b = (statistics.median(r[key] for r in results[c]) for c in CONFIGS)
        ratio = f"{b / a:.2f}" if a else "–"
        lines.append(f"| {label} | {a:,.3f} | {b:,.3f} | {ratio} |")
    runs = {c: [round(r["request_throughput"], 3) for r in results[c]] for c in CONFIGS}
    lines += ["", f"Capacity of each run (req/s): {runs}."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for run in range(args.repeats):
        for name, extra in CONFIGS.items():
            results[name].append(measure(name, extra, args.out, run, args.num_prompts,
                                         args.model))
    cpu = cpu_info()
    report = {"cpu": cpu, "model": args.model, "elapsed_s": round(time.time() - started),
              "results": results}
    text = (f"# Data parallel: two engines against one on {cpu['model']} ({cpu['cores']} "
            f"cores; {' '.join(cpu['flags'])})\n\nModel {args.model}, mixed workload, closed "
            f"loop of 16, {args.num_prompts} requests, {args.repeats} runs each, alternating; "
            f"command `python benchmarks/serving/dp_capacity.py --out {args.out}` "
            f"({report['elapsed_s']} s).\n\n" + table(results) + "\n")
    save_report(args.out, "dp_capacity", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
