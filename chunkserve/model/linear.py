"""Linear layers in the format the hardware is fastest with: dense, or int8 weights on the CPU.

`DenseLinear` is `F.linear` in the model's compute dtype (float32, or bfloat16 where the CPU
has native bf16 dot products, and on CUDA). `Int8Linear` is `--quantization int8`: weight-only
int8 with one scale per output channel, quantized once at load. A decode step is bound by
streaming the weights from memory, and int8 weights are a quarter of float32's bytes and half
of bfloat16's; PyTorch's CPU kernel for them (`_weight_int8pack_mm`) takes bfloat16 activations
and accumulates in float32 (given float32 activations it is 8x slower: they are always cast).
It pays for few rows only: past `INT8_KERNEL_MAX_ROWS` (a prefill chunk) the GEMM is
compute-bound, the int8 kernel is slower than a dense GEMM, and dequantizing the weight on
every call costs more than the GEMM itself (measured: 2.5 ms vs 1.6 ms for 64 rows of a
576x1536 weight). So the layer also keeps the dequantized weight in the compute dtype for those
rows: 1.25x float32's memory (1.5x bfloat16's), bought for decode steps that stream a quarter
(a half) of the bytes. The activations' precision is bfloat16's for decodes.

Dense weights on the CPU are kept in oneDNN's own blocked layout (`DenseWeight`): `F.linear` on
a plain weight goes through a per-call path that cost 1.2-1.6x more in bfloat16 at 1-64 rows
and, in float32 on an AMD CPU (MKL's sgemm), 2.3x more at every size (docs/performance.md).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# Rows (tokens) up to which the int8 kernel beats a GEMM on the dequantized (packed) weight:
# measured over 30 layers of SmolLM2's shapes from DRAM, int8 9.8 ms vs bf16 10.6 at 8 rows,
# 18.1 vs 12.8 at 16.
INT8_KERNEL_MAX_ROWS = 8
# Rows oneDNN is told to expect when it packs a weight (its layout; any row count works).
PACK_ROWS_HINT = 64


class Linear(Protocol):
    shape: tuple[int, int]  # (out_features, in_features), as the weight
    weight_bytes: int  # what a pass over the weights reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ...


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class DenseWeight:
    """`x @ weight.T` in the weight's dtype; on the CPU through a weight pre-packed for oneDNN
    (what PyTorch's own compiler does for frozen CPU linears), elsewhere plain `F.linear`."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.dtype = weight.dtype
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight.contiguous()
        if _can_pack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
            self.weight = None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)  # type: ignore[arg-type]


class DenseLinear:
    def __init__(self, weight: torch.Tensor) -> None:
        self.gemm = DenseWeight(weight)
        self.shape = tuple(weight.shape)  # type: ignore[assignment]
        self.weight_bytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


class Int8Linear:
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        """`dtype`: the activations' (the model's compute dtype), and the dense copy's."""
        w = weight.float()
        self.dtype = dtype
        # Symmetric per output channel; an all-zero row keeps a tiny scale instead of 0/0.
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        self.qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.scales = scales  # float32, for the dequantized path
        self.scales_bf16 = scales.to(torch.bfloat16)  # the kernel takes the activations' dtype
        self.dense = DenseWeight(self.dequantized().to(dtype))  # what prefill rows multiply by
        self.shape = tuple(weight.shape)  # type: ignore[assignment]
        # What a decode step reads; prefill chunks read `dense` (not counted: compute-bound).
        self.weight_bytes = self.qweight.numel() + 4 * scales.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8_KERNEL_MAX_ROWS:
            return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight,
                                             self.scales_bf16).to(self.dtype)
        return self.dense(x)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]


def make_linear(weight: torch.Tensor, quantization: str | None,
                dtype: torch.dtype | None = None) -> Linear:
    """`dtype`: the compute dtype (default: the weight's)."""
    dtype = dtype or weight.dtype
    if quantization is None:
        return DenseLinear(weight.to(dtype))
    if quantization == "int8":
        if weight.device.type != "cpu":
            raise ValueError("quantization 'int8' runs on the CPU only")
        return Int8Linear(weight, dtype)
    raise ValueError(f"quantization must be 'int8' or None, got {quantization!r}")
