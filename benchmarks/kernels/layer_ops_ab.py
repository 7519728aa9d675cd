"""The C RoPE op (`rope_split_qkv` in layer_ops.c: split a fused q/k/v projection, rotate q and
k) of this tree against a baseline commit's, called directly and alternately.

SmolLM2's heads (9 query, 3 KV, head size 64), bfloat16, 2 threads, at `--rows` tokens. Both
libraries are built from their sources (the baseline's taken from git) as the engine builds
them; a baseline from before issue 26 takes no rotary-dim / q-k-norm arguments and is called
without them. Prints the median microseconds per call of each, and whether the outputs agree.

    .venv/bin/python benchmarks/kernels/layer_ops_ab.py --baseline 7b50c6b [--rows 1,64,512]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # so that `benchmarks.*` imports when this file runs as a script
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.kernels.decode_kernel_ab import (  # noqa: E402
    KERNEL_DIR, baseline_sources, build_library)

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def build(source_dir: str, out_dir: str) -> Callable[..., None]:
    """rope_split_qkv of `source_dir`, called as (qkv, cos, sin, q, k, v, T) either way."""
    lib, text = build_library(source_dir, out_dir, "layer_ops.c")
    has_norm = "q_norm" in text
    fn = lib.rope_split_qkv
    fn.argtypes = [_P] * 6 + [_I] * 6 + ([_P, _P, _F, _I] if has_norm else [])
    fn.restype = None
    if has_norm:
        return lambda *a: fn(*a[:6], 1, a[6], HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM, None, None,
                             0.0, 2)
    return lambda *a: fn(*a[:6], 1, a[6], HEADS, KV_HEADS, HEAD_DIM, 2)


def time_rows(kernels: dict[str, Callable[..., None]], rows: int, rounds: int) -> None:
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16)
    cos, sin = torch.randn(rows, HEAD_DIM // 2), torch.randn(rows, HEAD_DIM // 2)
    outs = {name: [torch.empty(rows, h, HEAD_DIM, dtype=torch.bfloat16)
                   for h in (HEADS, KV_HEADS, KV_HEADS)] for name in kernels}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for r in range(rounds):
        order = list(kernels.items())
        for name, fn in order if r % 2 == 0 else reversed(order):
            ptrs = [t.data_ptr() for t in (qkv, cos, sin, *outs[name])]
            t0 = time.perf_counter()
            for _ in range(50):
                fn(*ptrs, rows)
            times[name].append((time.perf_counter() - t0) / 50)
    same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
    cells = " | ".join(f"{statistics.median(t) * 1e6:.1f}" for t in times.values())
    print(f"| {rows} | {cells} | {same} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    p.add_argument("--rows", default="1,64,512")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    print(f"{cpu_model()} | torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        kernels = {args.baseline: build(baseline_sources(args.baseline, base), base),
                   "this tree": build(os.path.join(REPO, KERNEL_DIR), tmp)}
        print(f"| rows | {args.baseline} us | this tree us | same output |\n|---:|---:|---:|---|")
        for rows in (int(r) for r in args.rows.split(",")):
            time_rows(kernels, rows, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
