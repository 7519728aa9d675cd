"""The AVX2 group GEMM (group_gemm_avx2.c) of this tree against a baseline commit's, called
directly and alternately on SmolLM2's four GEMM shapes.

Each call of a measurement runs `--layers` layers of the four shapes (576 -> 960, 576 -> 576,
576 -> 3072, 1536 -> 576), each layer with its own random levels and float16 scales: with 30
layers (SmolLM2's count, 53 MB of int4 levels) the weights stream from DRAM as in a decode
step; with 1 they stay in cache, as a prefill chunk's rows reuse them. Both kernels are built
as the engine builds them (`CHUNKSERVE_CPU_ISA`: `avx2` builds for an AVX2-only CPU on any
x86), and get the same inputs; prints ms per measurement (median of `--rounds`, the order
flipped each round), the ratio, and the largest difference of their outputs.

    CHUNKSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/kernels/group_gemm_ab.py \
        --baseline HEAD [--rows 1,8,16,20,64,256] [--layers 30] [--bits 4] [--threads 1]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # so that `benchmarks.*` imports when this file runs as a script
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.kernels.decode_kernel_ab import (  # noqa: E402
    KERNEL_DIR, baseline_sources, build_library)

# (K, N) of a layer's four GEMMs: qkv, o, gate_up, down
SHAPES = {"smollm2": ((576, 960), (576, 576), (576, 3072), (1536, 576)),
          "llama-3.2-1b": ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048))}
GROUP = 32
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load(source_dir: str, out_dir: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib, _ = build_library(source_dir, out_dir, "group_gemm_avx2.c")
    if not lib.group_gemm_avx2_supported():
        sys.exit("this build has no AVX2 group GEMM (no AVX2/FMA/F16C)")
    fn = lib.group_gemm_avx2
    fn.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64]
    fn.restype = ctypes.c_int
    return fn


def weights(layers: int, bits: int, rng: np.random.Generator, shapes: tuple[tuple[int, int], ...],
            centred: bool = False) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """(K, N, levels, scales) of every layer's four GEMMs, in the kernel's byte sizes: any bytes
    are valid levels; scales and minimums are float16 of ~0.01 (with `centred`, int4's
    minimums are -8 scales, as a GGUF's Q4_0 blocks load)."""
    out = []
    for _ in range(layers):
        for k, n in shapes:
            levels = rng.integers(0, 256, size=n * k // (8 // bits), dtype=np.uint8)
            per_group = 2 if bits == 4 else 1  # int4: a scale and a minimum
            scales = (rng.random(n * k // GROUP * per_group) * 0.02 - 0.01).astype(np.float16)
            if bits == 4 and centred:  # Q4_0's blocks: each group's minimum is -8 scale
                pairs = scales.reshape(-1, 2, 8)  # [blocks x groups, scale / minimum, 8]
                pairs[:, 1] = pairs[:, 0] * np.float16(-8)
            out.append((k, n, levels, scales))
    return out


def measure(fn: ctypes._CFuncPtr, w: list, x: np.ndarray,  # type: ignore[name-defined]
            y: np.ndarray, rows: int, bits: int, threads: int) -> float:
    t = time.perf_counter()
    for k, n, levels, scales in w:
        if fn(y.ctypes.data, x.ctypes.data, rows, k, levels.ctypes.data, scales.ctypes.data, n,
              bits, threads):
            sys.exit("the kernel failed (allocation)")
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    p.add_argument("--rows", default="1,8,16,20,64,256")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2",
                   help="whose four GEMM shapes a layer has")
    p.add_argument("--q4-0", action="store_true",
                   help="int4 minimums of -8 scales, as Q4_0's blocks load (else random)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    shapes = SHAPES[args.shapes]
    w = weights(args.layers, args.bits, rng, shapes, centred=args.q4_0)
    macs = sum(k * n for k, n, _, _ in w)  # a row's multiply-adds in one measurement
    minimums = " (Q4_0 minimums)" if args.q4_0 else ""
    print(f"{cpu_model()} | {args.threads} threads | int{args.bits}, {args.layers} layers of "
          f"{args.shapes}'s four GEMM shapes{minimums} "
          f"({sum(v[2].nbytes for v in w) / 1e6:.0f} MB of levels)")
    print(f"| rows | {args.baseline} ms | this tree ms | ratio (this tree / baseline) "
          "| this tree GMAC/s | max abs difference |\n|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        os.makedirs(base)
        kernels = {args.baseline: load(baseline_sources(args.baseline, base), base),
                   "this tree": load(os.path.join(REPO, KERNEL_DIR), tmp)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, max(k for k, _ in shapes))).astype(np.float32)
            ys = {name: np.zeros((rows, max(n for _, n in shapes)), np.float32)
                  for name in kernels}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            order = list(kernels.items())
            for r in range(args.rounds + 1):  # the first round warms up, and is dropped
                for name, fn in order if r % 2 == 0 else reversed(order):
                    spent = measure(fn, w, x, ys[name], rows, args.bits, args.threads)
                    if r:
                        times[name].append(spent)
            a, b = (statistics.median(t) * 1e3 for t in times.values())
            diff = float(np.abs(ys[args.baseline] - ys["this tree"]).max())
            print(f"| {rows} | {a:.2f} | {b:.2f} | {b / a:.3f} | {rows * macs / b / 1e6:.1f} "
                  f"| {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
