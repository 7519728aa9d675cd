"""Why `chunkserve serve` builds its engine on the thread that steps it (engine/compute_thread.py).

Times B=1 decode steps of SmolLM2 (engine defaults, ~128-token context) in three set-ups:
  main       the model loaded and stepped on the main thread (what engine_speed.py measures);
  second     loaded on the main thread, stepped on another one (the server before the fix);
  one-thread loaded and stepped on the same non-main thread (the server now: ComputeThread).
Each set-up runs in a fresh process (OpenMP pools live as long as the process); medians of
`--steps` steps, after one warm-up step.

    .venv/bin/python benchmarks/engine/thread_pools.py [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402

SETUPS = ("main", "second", "one-thread")


def build():  # type: ignore[no-untyped-def]
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.sampling_params import SamplingParams

    engine = LLMEngine.from_kwargs(model="smollm2-135m", max_model_len=1024, num_kv_blocks=128,
                                   enable_prefix_caching=False)
    params = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
    engine.add_request(None, [100 + i for i in range(128)], params)
    engine.step()  # the prefill, and a warm-up
    return engine


def median_step_ms(engine, steps: int) -> float:  # type: ignore[no-untyped-def]
    return statistics.median(engine.step().record.duration for _ in range(steps)) * 1e3


def run_setup(setup: str, steps: int) -> float:
    result: list[float] = []
    if setup == "main":
        return median_step_ms(build(), steps)
    if setup == "second":
        engine = build()
        target = lambda: result.append(median_step_ms(engine, steps))  # noqa: E731
    else:
        target = lambda: result.append(median_step_ms(build(), steps))  # noqa: E731
    t = threading.Thread(target=target)
    t.start()
    t.join()
    return result[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # one child process
    args = p.parse_args()
    if args.setup:
        print(f"{run_setup(args.setup, args.steps):.2f}")
        return
    print(cpu_model())
    print("| set-up | B=1 decode step, median ms |\n|---|---:|")
    for setup in SETUPS:
        out = subprocess.run([sys.executable, __file__, "--setup", setup, "--steps",
                              str(args.steps)], check=True, capture_output=True, text=True)
        print(f"| {setup} | {out.stdout.strip().splitlines()[-1]} |", flush=True)


if __name__ == "__main__":
    main()
