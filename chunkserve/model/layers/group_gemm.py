"""Weights quantized in groups of 32 inputs, multiplied by our C kernels: the decode rows of int4
(GGUF Q4_1: levels 0..15, a scale and a minimum a group) and int8 (Q8_0: levels -127..127, a
scale a group) layers. Three kernels; `available()` gives the first this CPU runs:
- "vnni", kernels/csrc/group_gemm_vnni.c, CPUs with AVX512_VNNI and AVX512_BF16: bfloat16
  activations, quantized to int8 per group of 32 inside the kernel for vpdpbusd (64 byte
  products an instruction), 16 output channels a vector. Faster than "bf16" at every row count
  and than the dense bf16 GEMM up to 2,048 rows (docs/performance.md, issue 54), so it takes
  every row;
- "bf16", kernels/csrc/group_gemm_bf16.c, the same CPUs: bfloat16 activations exact (each level
  widened to bf16 for vdpbf16ps), 16 output channels a vector; kept for `kernels()` and tests;
- "avx2", kernels/csrc/group_gemm_avx2.c, CPUs with AVX2/FMA/F16C: float32 activations,
  quantized to int8 per group of 32 inside the kernel for integer dot products (llama.cpp's
  way on such CPUs), 8 output channels a vector.

Each kernel reads its own channel-interleaved layout of the levels (see its C file), and the
scales (and minimums) as float16, as GGUF stores them, so a Q4_0/Q4_1/Q8_0 file's weights are
held exactly. `GroupGemm.int4` / `.int8` lay a layer's quantized weights out for the kernel;
calling it multiplies the activations.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkserve.model.kernels import cpu_library

GROUP = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block size


@dataclass(frozen=True)
class GroupKernel:
    name: str  # "vnni", "bf16" or "avx2"
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]

    @property
    def lanes(self) -> int:
        """Output channels a vector: levels are interleaved by this many channels."""
        return 8 if self.name == "avx2" else 16

    @property
    def activations(self) -> torch.dtype:
        return torch.float32 if self.name == "avx2" else torch.bfloat16


def available(target: str | None = None) -> GroupKernel | None:
    """This CPU's group GEMM, or None (no AVX2, or no C compiler). `target`: the instruction set
    to build for (cpu_library.ISAS; default CHUNKSERVE_CPU_ISA's)."""
    found = cpu_library.load_group_gemm(target)
    return None if found is None else GroupKernel(*found)


def kernels(target: str | None = None) -> dict[str, GroupKernel]:
    """Every group GEMM the build for `target` runs, by name, the one `available()` gives first
    (for tests and benchmarks that compare them)."""
    return {name: GroupKernel(name, fn) for name, fn in cpu_library.group_gemms(target).items()}


def fits_float16(*tensors: torch.Tensor) -> bool:
    """Whether scales (and minimums) survive float16 storage: |x| <= 65504. (Weights that need
    more fall back to PyTorch's kernels.)"""
    return all(bool(torch.isfinite(t.to(torch.float16)).all()) for t in tensors)


class GroupGemm:
    """One layer's levels and float16 scales in its kernel's layout, and the call."""

    def __init__(self, kernel: GroupKernel, bits: int, levels: torch.Tensor,
                 scales: torch.Tensor, n: int, max_rows: int) -> None:
        self.kernel, self.bits, self.levels, self.scales = kernel, bits, levels, scales
        self.n = n  # output channels (levels/scales are padded to a multiple of the lanes)
        self.max_rows = max_rows  # rows up to which it beats the dense GEMM (see the callers)
        self.weight_bytes = levels.numel() * levels.element_size() + scales.numel() * 2
        self.n_out = levels.shape[0] * kernel.lanes
        self.levels_ptr, self.scales_ptr = levels.data_ptr(), scales.data_ptr()
        self._activations, self._bf16 = kernel.activations, kernel.name != "avx2"
        # vnni and bf16 kernels: float32 for a float32 model (QuantizedLinear sets it): their
        # sums are float32 in the kernel, and a bfloat16 output would round them (and a tensor-parallel
        # rank's partial sums before the all-reduce, which then differ from one rank's whole
        # sum). The avx2 kernel always writes float32.
        self.out_dtype = torch.float32 if kernel.name == "avx2" else torch.bfloat16

    @classmethod
    def int4(cls, kernel: GroupKernel, levels: torch.Tensor, scale: torch.Tensor,
             low: torch.Tensor, max_rows: int) -> GroupGemm:
        """levels [N, K] 0..15, scale and low (minimum) [N, K/32]."""
        n, lanes = levels.shape[0], kernel.lanes
        levels, scale, low = _pad(lanes, levels, scale, low)
        packed = _PACK_INT4[kernel.name](levels.to(torch.uint8), lanes)
        # [N/lanes, K/32, 2, lanes] float16: scales, then minimums
        blocks, groups = levels.shape[0] // lanes, scale.shape[1]
        sc = torch.stack([scale, low]).to(torch.float16).reshape(
            2, blocks, lanes, groups).permute(1, 3, 0, 2).contiguous()
        return cls(kernel, 4, packed, sc, n, max_rows)

    @classmethod
    def int8(cls, kernel: GroupKernel, levels: torch.Tensor, scale: torch.Tensor,
             max_rows: int) -> GroupGemm:
        """levels [N, K] int8, scale [N, K/32] (float16 values)."""
        n, lanes = levels.shape[0], kernel.lanes
        levels, scale = _pad(lanes, levels, scale)
        blocks, groups = levels.shape[0] // lanes, scale.shape[1]
        lv = levels.to(torch.int8).reshape(blocks, lanes, groups, GROUP // 2, 2)
        if kernel.name == "bf16":  # [N/16, K/32, 16 pairs, 16 channels, 2]
            packed = lv.permute(0, 2, 3, 1, 4).contiguous()
        elif kernel.name == "vnni":  # [N/16, K/32, 8 quads, 16 channels x 4 inputs], + 128
            packed = (lv.reshape(blocks, lanes, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)
                      .to(torch.int16) + 128).to(torch.uint8).reshape(
                blocks, groups, GROUP // 4, 4 * lanes).contiguous()
        else:  # [N/8, K/32, 8 quads, 8 channels x 4 inputs]
            packed = lv.reshape(blocks, lanes, groups, GROUP // 4, 4).permute(
                0, 2, 3, 1, 4).reshape(blocks, groups, GROUP // 4, 4 * lanes).contiguous()
        # [N/lanes, K/32, lanes] float16
        sc = scale.to(torch.float16).reshape(blocks, lanes, groups).permute(0, 2, 1).contiguous()
        return cls(kernel, 8, packed, sc, n, max_rows)

    def dequantized(self) -> torch.Tensor:
        """The weights as held, float32 [N, K] (for the dense copy of prefill rows, and tests)."""
        lanes = self.kernel.lanes
        blocks, groups = self.levels.shape[:2]
        if self.bits == 4:
            lv = _UNPACK_INT4[self.kernel.name](self.levels, lanes)
            scale, low = (self.scales[:, :, i].permute(0, 2, 1).float() for i in (0, 1))
        else:
            lv = _unpack_int8(self.levels, self.kernel.name, lanes)
            scale, low = self.scales.permute(0, 2, 1).float(), torch.zeros(())
        lv = lv.reshape(blocks, lanes, groups, GROUP).float()
        w = lv * scale[..., None] + low[..., None]  # (low: a 0-d zero for int8)
        return w.reshape(blocks * lanes, groups * GROUP)[: self.n]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step makes ~120 of these calls: each microsecond here is ~2% of a B=1 step
        # (docs/performance.md), hence the checks before converting and the cached pointers.
        if x.dtype != self._activations:
            x = x.to(self._activations)
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.n_out, dtype=self.out_dtype)
        if self._bf16:
            failed = self.kernel.fn(
                y.data_ptr(), int(self.out_dtype == torch.bfloat16), x.data_ptr(), x.shape[0],
                x.shape[1], self.levels_ptr, self.scales_ptr, self.n_out, self.bits,
                torch.get_num_threads())
        else:
            failed = self.kernel.fn(y.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1],
                                    self.levels_ptr, self.scales_ptr, self.n_out, self.bits,
                                    torch.get_num_threads())
        if failed:
            raise MemoryError("the group GEMM could not allocate its buffer")
        return y if self.n_out == self.n else y[:, : self.n]


# ---- layouts (the C files' headers describe them) -------------------------------------------
def _pack_int4_bf16(levels: torch.Tensor, lanes: int) -> torch.Tensor:
    """[N/16, K/32, 16 pairs, 16 channels]: byte = level 2p | level 2p+1 << 4."""
    blocks, groups = levels.shape[0] // lanes, levels.shape[1] // GROUP
    lv = levels.reshape(blocks, lanes, groups, GROUP // 2, 2)
    return (lv[..., 0] | (lv[..., 1] << 4)).permute(0, 2, 3, 1).contiguous()


def _unpack_int4_bf16(packed: torch.Tensor, lanes: int) -> torch.Tensor:
    """[N/16, 16 channels, K/32, 32] levels from _pack_int4_bf16's layout."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).permute(0, 3, 1, 2, 4)


def _pack_int4_avx2(levels: torch.Tensor, lanes: int) -> torch.Tensor:
    """[N/8, K/32, 8 quads, 16 bytes]: byte 4c + i = channel c's level of input 4j + i (low
    nibble) | channel 4 + c's (high nibble), c < 4."""
    blocks, groups = levels.shape[0] // lanes, levels.shape[1] // GROUP
    lv = levels.reshape(blocks, lanes, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)
    half = lanes // 2  # lv: [blocks, groups, quads, channels, 4 inputs]
    return (lv[:, :, :, :half] | (lv[:, :, :, half:] << 4)).reshape(
        blocks, groups, GROUP // 4, 2 * lanes).contiguous()


def _unpack_int4_avx2(packed: torch.Tensor, lanes: int) -> torch.Tensor:
    blocks, groups = packed.shape[:2]
    bytes_ = packed.reshape(blocks, groups, GROUP // 4, lanes // 2, 4)
    lv = torch.cat([bytes_ & 15, bytes_ >> 4], dim=3)  # [blocks, groups, quads, channels, 4]
    return lv.permute(0, 3, 1, 2, 4)


def _pack_int4_vnni(levels: torch.Tensor, lanes: int) -> torch.Tensor:
    """[N/16, K/32, 4 pairs of quads, 64 bytes]: in pair j, byte 4c + i = channel c's level of
    input 4j + i (low nibble) | of input 16 + 4j + i (high nibble)."""
    blocks, groups = levels.shape[0] // lanes, levels.shape[1] // GROUP
    # [blocks, channels, groups, halves, quads j, 4 inputs i] -> [blocks, groups, halves, j, c, i]
    lv = levels.reshape(blocks, lanes, groups, 2, GROUP // 8, 4).permute(0, 2, 3, 4, 1, 5)
    return (lv[:, :, 0] | (lv[:, :, 1] << 4)).reshape(
        blocks, groups, GROUP // 8, 4 * lanes).contiguous()


def _unpack_int4_vnni(packed: torch.Tensor, lanes: int) -> torch.Tensor:
    blocks, groups = packed.shape[:2]
    bytes_ = packed.reshape(blocks, groups, GROUP // 8, lanes, 4)  # [B, G, j, c, i]
    lv = torch.stack([bytes_ & 15, bytes_ >> 4], dim=2)  # [B, G, halves, j, c, i]
    return lv.permute(0, 4, 1, 2, 3, 5).reshape(blocks, lanes, groups, GROUP)


_PACK_INT4 = {"bf16": _pack_int4_bf16, "avx2": _pack_int4_avx2, "vnni": _pack_int4_vnni}
_UNPACK_INT4 = {"bf16": _unpack_int4_bf16, "avx2": _unpack_int4_avx2, "vnni": _unpack_int4_vnni}


def _unpack_int8(packed: torch.Tensor, name: str, lanes: int) -> torch.Tensor:
    """[N/lanes, lanes channels, K/32, ...] levels from any kernel's int8 layout."""
    if name == "bf16":  # [B, G, 16 pairs, 16, 2]
        return packed.permute(0, 3, 1, 2, 4)
    blocks, groups = packed.shape[:2]  # [B, G, 8 quads, lanes channels x 4]
    if name == "vnni":  # stored as level + 128
        packed = (packed.to(torch.int16) - 128).to(torch.int8)
    return packed.reshape(blocks, groups, GROUP // 4, lanes, 4).permute(0, 3, 1, 2, 4)


def _pad(lanes: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero channels up to a whole vector (their outputs are dropped)."""
    pad = -tensors[0].shape[0] % lanes
    return tensors if not pad else tuple(F.pad(t, (0, 0, 0, pad)) for t in tensors)
