"""Weights quantized in groups of 32 inputs, multiplied by kernels/csrc/group_gemm_bf16.c: the
decode rows of int4 (GGUF Q4_1: levels 0..15, a scale and a minimum a group) and int8 (Q8_0:
levels -127..127, a scale a group) layers on CPUs with AVX512_BF16.

The kernel reads 16 output channels per vector: levels are stored channel-interleaved, group
by group, and scales (and minimums) as float16, as GGUF stores them, so a Q4_0/Q4_1/Q8_0
file's weights are held exactly. `GroupGemm.int4` / `.int8` lay a layer's quantized weights
out that way; calling it multiplies bfloat16 activations (float32 sums, bf16 output).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from chunkserve.model.kernels import cpu_library

GROUP = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block size
LANES = 16  # output channels per vector


def available() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return cpu_library.load_group_gemm()


def fits_float16(*tensors: torch.Tensor) -> bool:
    """Whether scales (and minimums) survive float16 storage: |x| <= 65504. (Weights that need
    more fall back to PyTorch's kernels.)"""
    return all(bool(torch.isfinite(t.to(torch.float16)).all()) for t in tensors)


class GroupGemm:
    """One layer's levels and float16 scales in the kernel's layout, and the call."""

    def __init__(self, fn: ctypes._CFuncPtr, bits: int, levels: torch.Tensor,  # type: ignore[name-defined]
                 scales: torch.Tensor, n: int, max_rows: int) -> None:
        self.fn, self.bits, self.levels, self.scales = fn, bits, levels, scales
        self.n = n  # output channels (levels/scales are padded to a multiple of LANES)
        self.max_rows = max_rows  # rows up to which it beats the dense GEMM (see the callers)
        self.weight_bytes = levels.numel() * levels.element_size() + scales.numel() * 2
        self.n_out = levels.shape[0] * LANES
        self.levels_ptr, self.scales_ptr = levels.data_ptr(), scales.data_ptr()
        # float32 for a float32 model (QuantizedLinear sets it): its sums are float32 in the
        # kernel, and a bfloat16 output would round them (and a tensor-parallel rank's partial
        # sums before the all-reduce, which then differ from one rank's whole sum).
        self.out_dtype = torch.bfloat16

    @classmethod
    def int4(cls, fn, levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,  # type: ignore[no-untyped-def]
             max_rows: int) -> GroupGemm:
        """levels [N, K] 0..15, scale and low (minimum) [N, K/32]."""
        n, k = levels.shape
        levels, scale, low = _pad(levels, scale, low)
        blocks, groups = levels.shape[0] // LANES, k // GROUP
        # [N/16, K/32, 16 pairs, 16 channels]: byte = level 2p | level 2p+1 << 4
        lv = levels.to(torch.uint8).reshape(blocks, LANES, groups, GROUP // 2, 2)
        packed = (lv[..., 0] | (lv[..., 1] << 4)).permute(0, 2, 3, 1).contiguous()
        # [N/16, K/32, 2, 16] float16: scales, then minimums
        sc = torch.stack([scale, low]).to(torch.float16).reshape(
            2, blocks, LANES, groups).permute(1, 3, 0, 2).contiguous()
        return cls(fn, 4, packed, sc, n, max_rows)

    @classmethod
    def int8(cls, fn, levels: torch.Tensor, scale: torch.Tensor,  # type: ignore[no-untyped-def]
             max_rows: int) -> GroupGemm:
        """levels [N, K] int8, scale [N, K/32] (float16 values)."""
        n, k = levels.shape
        levels, scale = _pad(levels, scale)
        blocks, groups = levels.shape[0] // LANES, k // GROUP
        # [N/16, K/32, 16 pairs, 16 channels, 2] int8; [N/16, K/32, 16] float16
        packed = levels.to(torch.int8).reshape(blocks, LANES, groups, GROUP // 2, 2).permute(
            0, 2, 3, 1, 4).contiguous()
        sc = scale.to(torch.float16).reshape(blocks, LANES, groups).permute(0, 2, 1).contiguous()
        return cls(fn, 8, packed, sc, n, max_rows)

    def dequantized(self) -> torch.Tensor:
        """The weights as held, float32 [N, K] (for the dense copy of prefill rows, and tests)."""
        blocks, groups = self.levels.shape[:2]
        if self.bits == 4:  # levels [B, G, 16 pairs, 16], scales [B, G, 2, 16]
            lv = torch.stack([self.levels & 15, self.levels >> 4], dim=-1).permute(0, 3, 1, 2, 4)
            scale, low = (self.scales[:, :, i].permute(0, 2, 1).float() for i in (0, 1))
        else:  # levels [B, G, 16 pairs, 16, 2], scales [B, G, 16]
            lv = self.levels.permute(0, 3, 1, 2, 4)
            scale, low = self.scales.permute(0, 2, 1).float(), torch.zeros(())
        lv = lv.reshape(blocks, LANES, groups, GROUP).float()
        w = lv * scale[..., None] + low[..., None]  # (low: a 0-d zero for int8)
        return w.reshape(blocks * LANES, groups * GROUP)[: self.n]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step makes ~120 of these calls: each microsecond here is ~2% of a B=1 step
        # (docs/performance.md), hence the checks before converting and the cached pointers.
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.n_out, dtype=self.out_dtype)
        bf16_out = int(self.out_dtype == torch.bfloat16)
        if self.fn(y.data_ptr(), bf16_out, x.data_ptr(), x.shape[0], x.shape[1], self.levels_ptr,
                   self.scales_ptr, self.n_out, self.bits, torch.get_num_threads()):
            raise MemoryError("the group GEMM could not allocate its buffer")
        return y if self.n_out == self.n else y[:, : self.n]


def _pad(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero channels up to a whole vector (their outputs are dropped)."""
    pad = -tensors[0].shape[0] % LANES
    return tensors if not pad else tuple(F.pad(t, (0, 0, 0, pad)) for t in tensors)
