"""What every weight-only quantized linear on the CPU shares (int8: linear.py, int4:
linear_int4.py): decode rows, up to the kernel's `max_rows`, multiply the quantized weights
through a kernel that streams few bytes; more rows (a prefill chunk) are compute-bound, where
most kernels lose to a dense GEMM, so they multiply a dense copy in the compute dtype. A kernel
that beats the dense GEMM at every row count (`max_rows` None: the avx2 and vnni group GEMMs,
whose int8 products outrun float32 FMAs and bfloat16 dot products) takes every row, and the
layer keeps no dense copy.

A dense copy costs 2-4 bytes a weight beside int4's half byte: an 8B Q4_0 model is 4.4 GiB of
blocks and 14 GiB of bfloat16 copies, more than many machines that run it with llama.cpp have.
So a copy is kept only while the machine keeps DENSE_RESERVE_BYTES available after it; past
that the kernel takes every row of the layer (prefill slower, nothing killed for memory), and
the load log says how many layers went without (`dense_copies_skipped`)."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from chunkserve.model.layers.dense_gemm import DenseWeight

GiB = 1 << 30
# What must stay available after a dense copy: the engine's default KV pool (2 GiB), a step's
# activations, and the tensors of the load still to come (one at a time, float32).
DENSE_RESERVE_BYTES = 4 * GiB
_skipped = 0  # dense copies left out for memory since the process started


def mem_available() -> int | None:
    """MemAvailable in bytes (Linux); None where the kernel does not say (keep the copies)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def room_for_dense_copy(nbytes: int) -> bool:
    free = mem_available()
    return free is None or free - nbytes >= DENSE_RESERVE_BYTES


def dense_copies_skipped() -> int:
    return _skipped


class QuantKernel(Protocol):
    max_rows: int | None  # rows up to which it beats the dense GEMM; None: at any count
    weight_bytes: int  # what a pass over the quantized weights reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ...


class QuantizedLinear:
    def __init__(self, kernel: QuantKernel, dense: Callable[[], torch.Tensor],
                 shape: tuple[int, int], dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        """`dense`: makes the weights as the kernel holds them (float32, `shape`), called only
        where a dense copy is kept: a kernel that takes every row needs none, and building one
        would cost each layer 4 bytes a weight of load time and peak memory for nothing;
        `dtype`: the activations' (the model's compute dtype), and the dense copy's; `bias`:
        kept in `dtype`, not quantized (Qwen2's q/k/v)."""
        self.kernel = kernel
        self.dtype = dtype
        if dtype == torch.float32 and hasattr(kernel, "out_dtype"):
            kernel.out_dtype = torch.float32  # no bfloat16 rounding of a float32 model's sums
        self.dense = None
        if kernel.max_rows is not None:
            if room_for_dense_copy(shape[0] * shape[1] * dtype.itemsize):
                self.dense = DenseWeight(dense().to(dtype), bias)
            else:
                global _skipped
                _skipped += 1
                kernel.max_rows = None  # every row through the kernel
        self.bias = None if bias is None else bias.to(dtype).contiguous()
        self.shape = shape
        # What a decode step reads; prefill chunks read `dense` (not counted: compute-bound).
        self.weight_bytes = kernel.weight_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is None or x.shape[0] <= self.kernel.max_rows:  # type: ignore[operator]
            y = self.kernel(x)
            y = y if y.dtype == self.dtype else y.to(self.dtype)
            return y if self.bias is None else y.add_(self.bias)
        return self.dense(x)
