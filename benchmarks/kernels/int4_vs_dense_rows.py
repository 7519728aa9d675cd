"""Up to how many rows the int4 group GEMM beats the dense bf16 copy, at a real model's shapes.

`linear_int4.C_KERNEL_MAX_ROWS` (32 for the bf16 kernel) was measured on SmolLM2's shapes, whose
30 layers of weights (~100 MB in int4) sit largely in a big L3. At 1-8B a layer's weights come
from DRAM: a step of more rows than that streams 2 bytes a weight from the dense copy instead of
~0.6 from the int4 blocks, and the mixed steps of chunked prefill (16 decode rows + a chunk of
some tens) are such steps. This times one pass over every layer's four linears (each layer its
own weights) both ways at each row count: the int4 C kernel forced to take every row, and the
packed dense bf16 GEMM (`DenseWeight`). Medians of --repeats.

    .venv/bin/python benchmarks/kernels/int4_vs_dense_rows.py --model llama-3.2-1b [--rows 16,32,64,128]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.common.timing import median_time  # noqa: E402

from chunkserve.model.layers import group_gemm, linear_int4  # noqa: E402
from chunkserve.model.layers.dense_gemm import DenseWeight  # noqa: E402
from chunkserve.model.layers.linear_int4 import Int4Linear  # noqa: E402
from chunkserve.model.models.registry import config_from_hf  # noqa: E402
from chunkserve.presets import model_preset  # noqa: E402


def shapes(preset: str) -> tuple[list[tuple[int, int]], int]:
    """The (out, in) shapes of one layer's qkv, o, gate_up and down, and the layer count."""
    c = config_from_hf(model_preset(preset), preset)
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [(q + 2 * kv, h), (h, q), (2 * c.intermediate_size, h), (h, c.intermediate_size)], \
        c.num_hidden_layers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a model preset")
    p.add_argument("--rows", default="1,16,32,64,128,256")
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    kernel = group_gemm.available()
    if kernel is None or kernel.activations != torch.bfloat16:
        p.error("this compares a bfloat16-activation group GEMM (vnni or bf16) with its dense "
                "bf16 copy: it needs AVX512_VNNI or AVX512_BF16 (the avx2 kernel takes every "
                "row already)")
    rows = [int(r) for r in args.rows.split(",")]
    layer_shapes, layers = shapes(args.model)
    layers = args.layers or layers
    linear_int4.C_KERNEL_MAX_ROWS[kernel.name] = None  # every row on the kernel, no dense copy
    print(f"{cpu_model()} | {torch.get_num_threads()} threads | {kernel.name} kernel | "
          f"{args.model}: {layers} layers of "
          f"{layer_shapes}", flush=True)
    int4, dense = [], []
    for _ in range(layers):
        for n, k in layer_shapes:
            w = torch.randn(n, k) * 0.02
            int4.append(Int4Linear(w, torch.bfloat16))
            dense.append(DenseWeight(w.bfloat16()))
    print("| rows | int4 C kernel ms | dense bf16 ms | int4 / dense |\n|---:|---:|---:|---:|")
    for b in rows:
        xs = {k: torch.randn(b, k).bfloat16() for _, k in layer_shapes}
        inputs = [xs[k] for _ in range(layers) for _, k in layer_shapes]
        a = median_time(lambda: [f(x) for f, x in zip(int4, inputs)], args.repeats)
        d = median_time(lambda: [f(x) for f, x in zip(dense, inputs)], args.repeats)
        print(f"| {b} | {a * 1e3:.1f} | {d * 1e3:.1f} | {a / d:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
