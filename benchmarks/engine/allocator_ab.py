"""A 2,048-token prefill step under glibc's default allocator settings and under fixed ones.

docs/reliability.md (item 15) weighs a fixed mmap threshold, which stops RSS growth under
hostile multi-MiB request bodies, against its cost to long prefill steps. glibc reads its
tunables at process start, so each setting runs in a fresh process, alternating:

    .venv/bin/python benchmarks/engine/allocator_ab.py [--rounds 3] [--only NAME ...]

Prints the CPU, then per round and setting the median of 3 timed steps (after one warm-up).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "default": {},
    "mmap 4 MiB": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)},
    "mmap 4 MiB + trim 256 MiB": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20),
                                  "MALLOC_TRIM_THRESHOLD_": str(256 << 20)},
    # The ceiling glibc's dynamic threshold climbs to, fixed from the start (serve/http/heap.py
    # between large request bodies).
    "mmap 32 MiB + trim 64 MiB": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                                  "MALLOC_TRIM_THRESHOLD_": str(64 << 20)},
}
PROMPT_TOKENS = 2040


def one_setting() -> None:
    """In the child: time single-step 2,040-token prefills of SmolLM2."""
    from chunkserve.llm import LLM
    from chunkserve.sampling_params import SamplingParams

    llm = LLM(model="smollm2-135m", max_num_batched_tokens=2048, max_model_len=4096)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for i in range(4):
        prompt = [100 + (i * 7 + j) % 30000 for j in range(PROMPT_TOKENS)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    print(f"{statistics.median(times[1:]):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="*", choices=list(SETTINGS), help="a subset of the settings")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        one_setting()
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common.host import cpu_model

    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
    settings = {k: v for k, v in SETTINGS.items() if not args.only or k in args.only}
    results: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(args.rounds):
        for name, env in settings.items():
            out = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, **env},
                                 capture_output=True, text=True, check=True).stdout
            results[name].append(float(out.strip().splitlines()[-1]))
            print(f"round {r + 1}: {name:28s} {results[name][-1]:.3f} s", flush=True)
    for name, times in results.items():
        print(f"{name:28s} median of rounds {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
