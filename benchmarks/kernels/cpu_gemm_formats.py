"""A decode step's GEMMs in every CPU weight format, as the model runs them.

30 layers of SmolLM2's four linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), each layer its own random weights so that they come from DRAM as in a real step,
times B rows: F.linear on a plain bf16 weight, the packed dense GEMM (`DenseWeight`, bf16 and
float32), and int8 and int4 weights on PyTorch's kernels and on the C group GEMM of this CPU
(group_gemm.py: "vnni" with AVX512_VNNI and BF16, else "avx2"), `Int8Linear` / `Int4Linear`
forced onto their kernels at every row count. The quantized layers take the activations their C kernel
takes (bfloat16, or float32 for "avx2"). Prints ms for all 120 GEMMs, medians of `--repeats`.

    .venv/bin/python benchmarks/kernels/cpu_gemm_formats.py [--rows 1,4,8,16,64]
    # an AVX2-only CPU's choices on an AVX-512 one (kernels and PyTorch kept to AVX2):
    CHUNKSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/kernels/...
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chunkserve.model.layers import group_gemm
from chunkserve.model.layers import linear
from chunkserve.model.layers import linear_int4
from chunkserve.model.layers.dense_gemm import DenseWeight
from chunkserve.model.layers.linear import Int8Linear
from chunkserve.model.layers.linear_int4 import Int4Linear

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.common.timing import median_time  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def on_pytorch_kernels(make: Callable[[], object]) -> object:
    """An Int4Linear / Int8Linear on PyTorch's kernel, even where the C group GEMM exists."""
    load, group_gemm.available = group_gemm.available, lambda: None
    try:
        return make()
    finally:
        group_gemm.available = load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,8,16,64")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    # Every quantized layer on its kernel, whatever the row count.
    linear.TorchInt8.max_rows = linear_int4.TorchInt4.max_rows = max(rows)
    for table in (linear.C_KERNEL_MAX_ROWS, linear_int4.C_KERNEL_MAX_ROWS):
        table.update(dict.fromkeys(table, max(rows)))
    kernel = group_gemm.available()
    c = kernel is not None
    act = kernel.activations if kernel is not None else torch.bfloat16
    print(f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
          f"C group GEMM: {kernel.name if kernel else 'none'}")
    weights = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    formats: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "F.linear bf16": [lambda x, w=w.bfloat16(): F.linear(x.bfloat16(), w)
                          for ws in weights for w in ws],
        "packed bf16": [DenseWeight(w.bfloat16()) for ws in weights for w in ws],
        "int8 PyTorch": [on_pytorch_kernels(lambda w=w: Int8Linear(w, act))
                         for ws in weights for w in ws],
        **({"int8 C": [Int8Linear(w, act) for ws in weights for w in ws]} if c else {}),
        "int4 PyTorch": [on_pytorch_kernels(lambda w=w: Int4Linear(w, act))
                         for ws in weights for w in ws],
        **({"int4 C": [Int4Linear(w, act) for ws in weights for w in ws]} if c else {}),
        "F.linear fp32": [lambda x, w=w: F.linear(x.float(), w) for ws in weights for w in ws],
        "packed fp32": [DenseWeight(w) for ws in weights for w in ws],
    }
    print("| rows | " + " | ".join(formats) + " |\n|---:|" + "---:|" * len(formats))
    for b in rows:
        xs = {k: torch.randn(b, k).to(act) for k in {k for _, k in SHAPES}}
        inputs = [xs[k] for _ in range(LAYERS) for _, k in SHAPES]
        cells = []
        for gemms in formats.values():
            ms = 1e3 * median_time(lambda g=gemms: [f(x) for f, x in zip(g, inputs)], args.repeats)
            cells.append(f"{ms:.2f}")
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
