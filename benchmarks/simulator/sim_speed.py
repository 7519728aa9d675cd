"""How long the simulator takes for one 2,000-request configuration (issue 13's ≤ 2 s).

The workload is `chunkserve sim`'s (A100-80GB, Llama-3-8B, the mixed dataset, 8 req/s); each
chunk size is simulated `--repeats` times in this process, so imports and plotting are left
out: this is the engine loop on the cost model, nothing else. CPU time, not wall time, is
reported (a shared host's other tenants mostly show up as wall time); both median and minimum,
because the minimum is the least disturbed run.

    .venv/bin/python benchmarks/simulator/sim_speed.py                 # ~30 s
    .venv/bin/python benchmarks/simulator/sim_speed.py --no-enable-prefix-caching
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.cli import build_parser
from chunkserve.sim.cli import sim_workbench

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk-sizes", default="512,1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    args = p.parse_args()
    sim_argv = ["sim", "--hardware", "a100-80gb", "--model", "llama-3-8b", "--dataset-name",
                "mixed", "--request-rate", "8", "--num-prompts", str(args.num_prompts),
                "--out", "unused"]
    if args.no_enable_prefix_caching:
        sim_argv.append("--no-enable-prefix-caching")
    bench = sim_workbench(build_parser().parse_args(sim_argv), log=lambda _: None)
    print(f"{cpu_model()} | {platform.python_implementation()} {platform.python_version()} | "
          f"{args.num_prompts} requests, prefix caching "
          f"{'off' if args.no_enable_prefix_caching else 'on'}")
    print("| chunk size | steps | CPU s median | CPU s min | runs |")
    print("|---|---|---|---|---|")
    for size in (int(s) for s in args.chunk_sizes.split(",")):
        times, steps = [], 0
        for _ in range(args.repeats):
            start = time.process_time()
            run = bench.run(SweepPoint(size, "decode-first"))
            times.append(time.process_time() - start)
            steps = len(run.records)
        print(f"| {size} | {steps} | {statistics.median(times):.2f} | {min(times):.2f} | "
              f"{', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
