"""`--quantization int4`: weight-only int4 linears on the CPU, 32 weights a group.

Each group of 32 consecutive input weights of an output channel is stored as 4-bit levels
0..15 with its own scale and minimum (w = minimum + level * scale). That is exactly GGUF's
Q4_1 block (and Q4_0's, whose minimum is -8 scales): the default model's linear weights are
Q4_1, so for them int4 is not a further approximation, unlike int8's one scale per channel;
re-quantizing a dequantized Q4_1 or Q4_0 tensor gives back its blocks (`exact_int4`). Decode rows
(up to the kernel's `max_rows`) run an int4 kernel, which streams ~half of int8's bytes: our
own where the CPU has AVX2 (group_gemm.py: bfloat16 activations with AVX512_BF16, else float32
ones quantized to int8 in the kernel), elsewhere PyTorch's (`TorchInt4`,
`_weight_int4pack_mm_for_cpu`, bfloat16 activations). Prefill rows, compute-bound, multiply a
dense copy in the compute dtype, as `Int8Linear` does.
"""
from __future__ import annotations

import torch

from chunkserve.model.layers import group_gemm
from chunkserve.model.layers.group_gemm import GROUP
from chunkserve.model.layers.quant_linear import QuantizedLinear

LEVELS = 15
# Rows up to which each C kernel (group_gemm.py) beats the packed dense GEMM; None: every row,
# and no dense copy. vnni, on a Zen 5 (benchmarks/kernels/int4_vs_dense_rows.py): 0.34x the
# dense bf16 time at 1 row, 0.60x at 8-32, 0.85-0.90x at 64-2,048 over Llama-3.2-1B's 16 layers;
# 0.33-0.84x at 1-512 rows on SmolLM2's (docs/performance.md, issue 54). bf16 (measured with
# benchmarks/kernels/cpu_gemm_formats.py, 30 layers of SmolLM2's shapes), on a Zen 5, two
# runs: 16.5 / 16.1 vs 17.4 / 17.1 ms at 32 rows; 27.0 / 30.4 vs 28.9 / 26.2 at 64, a tie within
# the noise. avx2: against packed float32 on AVX2 (oneDNN kept to AVX2) it was faster at every
# count measured, 1-256 rows (docs/performance.md, "AVX2 group GEMM").
C_KERNEL_MAX_ROWS: dict[str, int | None] = {"vnni": None, "bf16": 32, "avx2": None}


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels int32 [N, K], scales [N, K / GROUP], minimums [N, K / GROUP]), float32 w."""
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / LEVELS).clamp_min(1e-12)  # a constant group keeps a tiny scale
    levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, LEVELS)
    return levels.to(torch.int32).reshape(n, k), scale, low


def dequantize_int4(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    n, k = levels.shape
    groups = levels.reshape(n, k // GROUP, GROUP).float() * scale[..., None] + low[..., None]
    return groups.reshape(n, k)


Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # levels, scales, minimums


def exact_int4(w: torch.Tensor) -> Quantized | None:
    """w's int4 form when w (float32) already is 4-bit in groups of 32, as a Q4_0/Q4_1 GGUF's
    weights: re-quantized, every weight comes back to within a thousandth of its group's step.
    None otherwise.

    A Q4_1 group spans its levels 0..15 (its minimum and maximum are its own weights), so its
    min/max step is exact. A Q4_0 group is (q - 8) * d with its largest |w| at q = 0: the far
    end of its range is -8d, the near one 7d, which its weights need not reach. So each group
    also tries that grid, from either end (d > 0: low = min, step = -min / 8; d < 0: the
    largest weight is -8d, step = max / 8, low = -7 steps). Without it a Q4_0 file, the most
    common of them, ran int8: 1.8x the bytes a decode step streams.

    A tensor whose every group is Q4_0's first takes Q4_0's own form (`signed_q4_0`), so that
    its minimums are exactly -8 scales: the avx2 kernel then skips the minimum's term."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        return None
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    signed = signed_q4_0(groups)
    if signed is not None:
        return signed
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    candidates = ((high - low) / LEVELS, low), (-low / 8, low), (high / 8, -7 * high / 8)
    chosen = None
    for step, base in candidates:
        step = step.clamp_min(1e-12)
        levels = torch.round((groups - base[..., None]) / step[..., None]).clamp_(0, LEVELS)
        err = (base[..., None] + levels * step[..., None] - groups).abs()
        fits = (err <= 1e-3 * step[..., None] + 1e-7).all(dim=-1)
        if chosen is None:
            chosen = (levels, step, base, fits)
            continue
        take = fits & ~chosen[3]
        chosen = (torch.where(take[..., None], levels, chosen[0]),
                  torch.where(take, step, chosen[1]), torch.where(take, base, chosen[2]),
                  chosen[3] | fits)
        if bool(chosen[3].all()):
            break
    assert chosen is not None
    if not bool(chosen[3].all()):
        return None
    return chosen[0].to(torch.int32).reshape(n, k), chosen[1], chosen[2]


def signed_q4_0(groups: torch.Tensor) -> Quantized | None:
    """groups [N, K / 32, 32] as Q4_0 blocks, w = (q - 8) d, when every group is one: (levels
    [N, K] int32, scales d, minimums -8 d), d of either sign. Else None.

    Decided for the whole tensor, not group by group, so that a Q4_1 tensor, a few of whose
    groups may also fit this grid by chance, keeps the min/max grid for all of them (the
    default model's tokens then stay as they were). Q4_0's quantizer maps a group's value of
    largest |w| to q = 0, so d is that value over -8; an all-zero group keeps d = 0."""
    at = groups.abs().argmax(dim=-1, keepdim=True)
    d = groups.gather(-1, at).squeeze(-1) / -8
    # An all-zero group divides by 1 instead of 0: its levels come out 8, (8 - 8) * 0 = 0.
    levels = torch.round(groups / torch.where(d == 0, 1.0, d)[..., None]) + 8
    err = ((levels - 8) * d[..., None] - groups).abs()
    if bool((levels < 0).any() or (levels > LEVELS).any()) or \
            not bool((err <= 1e-3 * d.abs()[..., None] + 1e-7).all()):
        return None
    return levels.to(torch.int32).reshape(groups.shape[0], -1), d, -8 * d


class TorchInt4:
    """PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`), bfloat16 activations."""

    max_rows = 8  # where it stops beating the packed dense GEMM (8.0 vs 10.6 ms, 14.6 vs 12.8)

    def __init__(self, levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> None:
        self.packed = torch._convert_weight_to_int4pack_for_cpu(levels, 1)
        # The kernel's form: w = (level - 8) * scale + zero, [K / GROUP, N, 2] in the
        # activations' dtype (bfloat16: PyTorch's kernel takes no float32 scales with it).
        zero = low + 8 * scale
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(
            torch.bfloat16)
        n, k = levels.shape
        self.weight_bytes = n * k // 2 + self.scales_zeros.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed,
                                                 GROUP, self.scales_zeros)


class Int4Linear(QuantizedLinear):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32,
                 quantized: Quantized | None = None, bias: torch.Tensor | None = None) -> None:
        """`dtype`: the activations' (the model's compute dtype), and the dense copy's.
        `quantized`: weight's quantize_int4 when the caller has it already (exact_int4)."""
        if weight.shape[1] % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {weight.shape[1]}")
        levels, scale, low = quantized or quantize_int4(weight.float())
        c = group_gemm.available()
        if c is not None and group_gemm.fits_float16(scale, low):
            kernel = group_gemm.GroupGemm.int4(c, levels, scale, low, C_KERNEL_MAX_ROWS[c.name])
            # Prefill rows multiply the same weights (its float16 scales: exact for a GGUF's
            # blocks, and what its decode rows use).
            super().__init__(kernel, kernel.dequantized, tuple(weight.shape), dtype, bias)
        else:
            super().__init__(TorchInt4(levels, scale, low),
                             lambda: dequantize_int4(levels, scale, low), tuple(weight.shape),
                             dtype, bias)
