"""Where a decode step's time goes at real sizes: each linear's share, timed inside the engine's
own steps, and the rest (attention, norms, RoPE, sampling, Python). With --prefill N, the same
for a step that prefills one N-token prompt (each linear then also says the GMAC/s it reached).

PyTorch's profiler sees little of a step here: the model runs on the engine's compute thread
and every quantized linear is one ctypes call into our C group GEMM. So this wraps
QuantizedLinear.__call__ with a clock for the measured steps (a few hundred calls a step; the
clock's ~0.1 us each is under 0.5% of a 1B step) and sums by weight shape. Each row also says
the bandwidth that linear reached: bytes it streams (as stored) over its time.

    .venv/bin/python benchmarks/engine/decode_profile.py --model FILE.gguf [--batch 1] [--steps 16]
        [--prefill 512]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.engine.engine_speed import (DECODE_CONTEXT, make_engine, prompt,  # noqa: E402
                                            run_prefill)

from chunkserve.model.factory import load_model, weight_formats  # noqa: E402
from chunkserve.model.layers import quant_linear  # noqa: E402
from chunkserve.sampling_params import SamplingParams  # noqa: E402

Key = tuple[tuple[int, int], int]  # (weight shape, weight bytes)


@contextmanager
def timed_linears(spent: dict[Key, list[float]]) -> Iterator[None]:
    """Adds each QuantizedLinear call's seconds and one call to spent[(shape, bytes)]."""
    plain = quant_linear.QuantizedLinear.__call__

    def call(self: quant_linear.QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = plain(self, x)
        entry = spent[(self.shape, self.weight_bytes)]
        entry[0] += time.perf_counter() - start
        entry[1] += 1
        return y

    quant_linear.QuantizedLinear.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        quant_linear.QuantizedLinear.__call__ = plain  # type: ignore[method-assign]


def profile_steps(model: str, batch: int,
                  steps: int) -> tuple[float, dict[Key, tuple[float, float]], str]:
    """(mean step seconds, {key: (seconds, calls) per step}, the linears' formats) over `steps`
    pure decode steps of `batch` requests of DECODE_CONTEXT-token prompts."""
    loaded = load_model(model, "auto", max_model_len=4096 + 512)
    engine, max_tokens = make_engine(loaded, (4096,), (batch,), steps)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, prompt(DECODE_CONTEXT, 1000 + i), params)
    while engine.step().record.num_prefill_tokens:  # the prompts, then one decode step
        pass
    spent: dict[Key, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    total = 0.0
    try:
        with timed_linears(spent):
            for _ in range(steps):
                total += engine.step().record.duration
    finally:
        engine.close()
    per_step = {k: (t / steps, n / steps) for k, (t, n) in spent.items()}
    return total / steps, per_step, weight_formats(loaded.model)


def profile_prefill(model: str, tokens: int,
                    steps: int) -> tuple[float, dict[Key, tuple[float, float]], str]:
    """As profile_steps, over `steps` steps that each prefill one fresh `tokens`-token prompt."""
    loaded = load_model(model, "auto", max_model_len=tokens + 512)
    engine, _ = make_engine(loaded, (tokens,), (1,), 1)
    spent: dict[Key, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    total = 0.0
    try:
        run_prefill(engine, tokens, salt=0)  # warm the kernels and the allocator once
        with timed_linears(spent):
            for r in range(steps):
                total += run_prefill(engine, tokens, salt=r + 1)
    finally:
        engine.close()
    per_step = {k: (t / steps, n / steps) for k, (t, n) in spent.items()}
    return total / steps, per_step, weight_formats(loaded.model)


def report(step: float, spent: dict[Key, tuple[float, float]], batch: int,
           rows: int | None = None) -> str:
    """`rows`: the tokens each linear call multiplies (the batch in decode, the default; the
    prompt in prefill, where the head's call takes fewer, so its GMAC/s is an upper bound)."""
    rows = batch if rows is None else rows
    title = f"B={batch}" if rows == batch else f"prefill of {rows} tokens"
    lines = [f"{title}: step {step * 1e3:.2f} ms", "",
             "| linear (out x in) | calls / step | MB streamed / step | ms / step | share | GB/s "
             "| GMAC/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for ((n, k), nbytes), (seconds, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        streamed = nbytes * calls
        lines.append(f"| {n} x {k} | {calls:.0f} | {streamed / 1e6:.0f} | {seconds * 1e3:.2f} | "
                     f"{seconds / step:.0%} | {streamed / seconds / 1e9:.1f} "
                     f"| {rows * n * k * calls / seconds / 1e9:.1f} |")
    rest = step - sum(t for t, _ in spent.values())
    lines.append(f"| everything else (attention, norms, RoPE, sampling, Python) | | | "
                 f"{rest * 1e3:.2f} | {rest / step:.0%} | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF (or any --model value)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prefill", type=int, default=0,
                   help="profile steps that prefill one prompt of this many tokens instead")
    args = p.parse_args()
    print(cpu_model(), flush=True)
    if args.prefill:
        step, spent, formats = profile_prefill(args.model, args.prefill, args.steps)
        rows = args.prefill
    else:
        step, spent, formats = profile_steps(args.model, args.batch, args.steps)
        rows = args.batch
    print(f"linears: {formats}\n\n{report(step, spent, args.batch, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
