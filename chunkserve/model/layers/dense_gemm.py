"""Dense GEMMs, `x @ weight.T (+ bias)`: on the CPU through a weight pre-packed for oneDNN.

`F.linear` on a plain weight goes through a per-call path that cost 1.2-1.6x more in bfloat16
at 1-64 rows and, in float32 on an AMD CPU (MKL's sgemm), 2.3x more at every size than
PyTorch's oneDNN linear on a weight packed once into oneDNN's blocked layout (what PyTorch's
compiler does for frozen CPU linears; docs/performance.md). Results are F.linear's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows oneDNN is told to expect when it packs a weight (its layout; any row count works).
PACK_ROWS_HINT = 64


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class DenseWeight:
    """`x @ weight.T (+ bias)` in the weight's dtype; on the CPU through a weight pre-packed for
    oneDNN (what PyTorch's own compiler does for frozen CPU linears), elsewhere plain
    `F.linear`. The bias (Qwen2's q/k/v) is added by the same call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.to(weight.dtype).contiguous()
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight.contiguous()
        if _can_pack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS_HINT)
            self.weight = None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]
