"""Linear layers in the format the hardware is fastest with: dense, or int8 / int4 weights on the
CPU (int4: linear_int4.py).

`DenseLinear` is a dense GEMM in the model's compute dtype (float32, or bfloat16 where the CPU
has native bf16 dot products, and on CUDA). `Int8Linear` is `--quantization int8`: weight-only
int8, quantized once at load: in groups of 32 inputs with a float16 scale each through our C
kernels on CPUs with AVX2 (group_gemm.py), else with one scale per output channel through
PyTorch's kernel (what follows describes that one; the C kernels' trade-offs are the same).
A decode step is bound by streaming the weights from memory, and int8 weights are a quarter of
float32's bytes and half of bfloat16's; PyTorch's CPU kernel for them (`_weight_int8pack_mm`)
takes bfloat16 activations and accumulates in float32 (given float32 activations it is 8x
slower: they are always cast).
It pays for few rows only: past `INT8_KERNEL_MAX_ROWS` (a prefill chunk) the GEMM is
compute-bound, the int8 kernel is slower than a dense GEMM, and dequantizing the weight on
every call costs more than the GEMM itself (measured: 2.5 ms vs 1.6 ms for 64 rows of a
576x1536 weight). So the layer also keeps the dequantized weight in the compute dtype for those
rows: 1.25x float32's memory (1.5x bfloat16's), bought for decode steps that stream a quarter
(a half) of the bytes. The activations' precision is bfloat16's for decodes.

Dense weights go through `DenseWeight` (dense_gemm.py: on the CPU, pre-packed for oneDNN).
"""
from __future__ import annotations

from typing import Protocol

import torch

from chunkserve.model.layers import group_gemm
from chunkserve.model.layers.dense_gemm import DenseWeight
from chunkserve.model.layers.group_gemm import GROUP
from chunkserve.model.layers.linear_int4 import Int4Linear, exact_int4
from chunkserve.model.layers.quant_linear import QuantizedLinear

# Rows (tokens) up to which PyTorch's int8 kernel beats a GEMM on the dequantized (packed)
# weight: measured over 30 layers of SmolLM2's shapes from DRAM, int8 9.8 ms vs bf16 10.6 at 8
# rows, 18.1 vs 12.8 at 16.
INT8_KERNEL_MAX_ROWS = 8
# The same for the C group GEMMs' int8 (group_gemm.py). bf16: 5.9 vs 9.1 ms at 8 rows, 11.4 vs
# 11.2 at 16 (docs/performance.md). vnni and avx2: None, every row (as
# linear_int4.C_KERNEL_MAX_ROWS; vnni's int8 sums run at its int4 rate, 1.3 TOP/s from cache on
# a Zen 5 at 32-64 rows against the bf16 kernel's 0.43).
C_KERNEL_MAX_ROWS: dict[str, int | None] = {"vnni": None, "bf16": 16, "avx2": None}


class Linear(Protocol):
    shape: tuple[int, int]  # (out_features, in_features), as the weight
    weight_bytes: int  # what a pass over the weights reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.gemm = DenseWeight(weight, bias)
        self.shape = tuple(weight.shape)  # type: ignore[assignment]
        self.weight_bytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


class TorchInt8:
    """One scale per output channel, PyTorch's CPU kernel (`_weight_int8pack_mm`, bf16
    activations, float32 sums)."""

    max_rows = INT8_KERNEL_MAX_ROWS

    def __init__(self, w: torch.Tensor, row_absmax: torch.Tensor | None = None) -> None:
        """`row_absmax`: each output channel's largest |w| over all its inputs, when `w` holds
        only some (a tensor-parallel rank's row-parallel shard); default: `w`'s own."""
        # Symmetric per output channel; an all-zero row keeps a tiny scale instead of 0/0.
        absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()
        scales = (absmax / 127.0).clamp_min(1e-12)
        self.qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.scales = scales  # float32, for the dequantized path
        self.scales_bf16 = scales.to(torch.bfloat16)  # the kernel takes the activations' dtype
        self.weight_bytes = self.qweight.numel() + 4 * scales.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight,
                                         self.scales_bf16)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]


def quantize_int8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int8 [N, K], scales [N, K/32]): symmetric per group of 32 inputs, GGUF's Q8_0.
    The scales are rounded to float16 first (as the kernel stores them) and the levels taken
    against those, so a Q8_0 file's weights come back exactly."""
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    scales = (groups.abs().amax(dim=-1) / 127.0).to(torch.float16).float()
    levels = torch.round(groups / scales.clamp_min(1e-30)[..., None]).clamp_(-127, 127)
    return levels.to(torch.int8).reshape(n, k), scales


class Int8Linear(QuantizedLinear):
    """`--quantization int8`. On CPUs with AVX2: int8 levels in groups of 32 inputs, each with a
    float16 scale (GGUF's Q8_0), through a C group GEMM (group_gemm.py): both finer and faster
    than one scale per channel. Elsewhere: one scale per channel through PyTorch's kernel."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32,
                 bias: torch.Tensor | None = None, row_absmax: torch.Tensor | None = None
                 ) -> None:
        """`row_absmax`: see TorchInt8 (groups of 32 need none: a shard keeps whole groups)."""
        w = weight.float()
        c = group_gemm.available() if w.shape[1] % GROUP == 0 else None
        levels, scales = quantize_int8_groups(w) if c is not None else (None, None)
        kernel: TorchInt8 | group_gemm.GroupGemm
        if c is not None and levels is not None and group_gemm.fits_float16(scales):
            kernel = group_gemm.GroupGemm.int8(c, levels, scales, C_KERNEL_MAX_ROWS[c.name])
        else:
            kernel = TorchInt8(w, row_absmax)
        super().__init__(kernel, kernel.dequantized, tuple(w.shape), dtype, bias)

    def dequantized(self) -> torch.Tensor:
        """The weights as the kernel holds them, in float32."""
        return self.kernel.dequantized()  # type: ignore[attr-defined]


def make_linear(weight: torch.Tensor, quantization: str | None,
                dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
                row_absmax: torch.Tensor | None = None) -> Linear:
    """`dtype`: the compute dtype (default: the weight's). `quantization`: None (dense), "int8",
    "int4" (linear_int4.py), or "auto": int4 where the weight already is 4-bit in GGUF's
    blocks (exact), else int8. `bias` (or None) is added in the compute dtype, never
    quantized. `row_absmax`: a tensor-parallel shard's full rows' largest |w| (TorchInt8)."""
    dtype = dtype or weight.dtype
    if quantization is None:
        return DenseLinear(weight.to(dtype), bias)
    if quantization not in ("int8", "int4", "auto"):
        raise ValueError(f"quantization must be 'int8', 'int4', 'auto' or None, "
                         f"got {quantization!r}")
    if weight.device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only")
    if quantization == "int4":
        return Int4Linear(weight, dtype, bias=bias)
    exact = exact_int4(weight.float()) if quantization == "auto" else None
    if exact:
        return Int4Linear(weight, dtype, exact, bias)
    return Int8Linear(weight, dtype, bias, row_absmax)
