"""Attention of one layer on the CPU: the `cpu` backend's decode kernel vs per-request SDPA,
and PyTorch's SDPA over prefill chunks in float32 vs bfloat16.

Times `forward` of both backends (metadata built once, as the engine does once per step) for S
decodes of L context tokens each, SmolLM2's heads (9 query, 3 KV, head size 64), blocks of 16
in a shuffled order (a served pool is not laid out request by request), in float32 and
bfloat16 caches. Both are measured alternately in the same process; medians of repeated calls.
The effective bandwidth counts the K and V bytes every decode must read. Then a whole-prompt
causal chunk of each `--prefill` length through SDPA, as both backends run it (K/V repeated
per query head), float32 and bfloat16 in alternation: why the KV cache follows the model dtype.

    .venv/bin/python benchmarks/kernels/cpu_attention.py [--shapes 1x512,8x512,32x512,64x512,4x4096]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

from chunkserve.model.attention.cpu_backend import CpuPagedAttention
from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.batch import BatchLayout, DeviceStager

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.common.timing import median_time  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_layout(num_seqs: int, context: int, seed: int = 0) -> BatchLayout:
    width = -(-context // BLOCK)
    table = np.random.default_rng(seed).permutation(num_seqs * width).reshape(num_seqs, width)
    pos = np.full(num_seqs, context - 1, dtype=np.int64)
    slots = table[np.arange(num_seqs), pos // BLOCK] * BLOCK + pos % BLOCK
    return BatchLayout(np.zeros(num_seqs, np.int64), pos, slots,
                       np.arange(num_seqs + 1, dtype=np.int64),
                       np.full(num_seqs, context, np.int64), table.astype(np.int64), BLOCK)


def median_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    return median_time(fn, repeats) * 1e3


@torch.inference_mode()
def measure(num_seqs: int, context: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    layout = decode_layout(num_seqs, context)
    batch = DeviceStager(torch.device("cpu")).to_device(layout)
    blocks = layout.block_table.size + 1
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
              for _ in range(2))
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    result = {}
    backends = [TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM),
                CpuPagedAttention(HEADS, KV_HEADS, HEAD_DIM)]
    metas = [b.build_metadata(batch) for b in backends]
    times: dict[str, list[float]] = {b.name: [] for b in backends}
    for r in range(5):  # alternate the two, flipping the order each round
        pairs = list(zip(backends, metas))
        for backend, meta in pairs if r % 2 == 0 else reversed(pairs):
            times[backend.name].append(median_ms(
                lambda: backend.forward(q, k, v, kc, vc, meta), repeats))  # noqa: B023
    for name, ts in times.items():
        result[name] = statistics.median(ts)
    kv_mb = 2 * num_seqs * context * KV_HEADS * HEAD_DIM * kc.element_size() / 1e6
    result["kv_mb"] = kv_mb
    return result


@torch.inference_mode()
def prefill_sdpa(n: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) for _ in range(3)]
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for r in range(5):
        for name in ("float32", "bfloat16") if r % 2 == 0 else ("bfloat16", "float32"):
            q, k, v = (t.to(getattr(torch, name)) for t in qkv)
            times[name].append(median_ms(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),  # noqa: B023
                repeats))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x512,8x512,32x512,64x512,4x4096,1x4096",
                   help="decodes x context, comma-separated")
    p.add_argument("--prefill", default="512,2048", help="chunk lengths for the SDPA dtype test")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads")
    print("| KV dtype | decodes x context | K+V MB | torch (SDPA per request) ms | cpu kernel ms "
          "| kernel GB/s | torch / kernel |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in args.shapes.split(","):
            s, ctx = (int(x) for x in shape.split("x"))
            r = measure(s, ctx, dtype, args.repeats)
            print(f"| {str(dtype).removeprefix('torch.')} | {s} x {ctx} | {r['kv_mb']:.1f} | "
                  f"{r['torch']:.3f} | {r['cpu']:.3f} | {r['kv_mb'] / r['cpu']:.1f} | "
                  f"{r['torch'] / r['cpu']:.2f} |", flush=True)
    print("\n| prefill chunk (causal) | float32 SDPA ms | bfloat16 SDPA ms | fp32 / bf16 |")
    print("|---|---:|---:|---:|")
    for n in (int(x) for x in args.prefill.split(",")):
        t = prefill_sdpa(n, args.repeats)
        print(f"| {n} | {t['float32']:.2f} | {t['bfloat16']:.2f} | "
              f"{t['float32'] / t['bfloat16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
