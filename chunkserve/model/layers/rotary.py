"""Rotary position embeddings: the inverse frequencies for each `rope_scaling` type
(rope_scaling.py checks and normalizes the dict) and a cos/sin table indexed by position.

Frequencies are computed in float32 with the same operations, in the same order, as
transformers, so the tables equal its cos/sin bit for bit (tests/test_rotary.py checks each
type): parity with the reference matters more here than the last ulp of exactness."""
from __future__ import annotations

import math
from typing import Any

import torch

from chunkserve.model.layers.rope_scaling import normalize_rope_scaling, rope_attention_factor


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """float32 inverse frequencies over `head_dim` (pass the rotary dim for partial rotary).
    `max_positions` (the longest context the engine serves) picks LongRoPE's factor list."""
    s = normalize_rope_scaling(scaling, None, None, head_dim)
    rope_type = "default" if s is None else s["rope_type"]
    if rope_type == "default":
        return _base_inv_freq(head_dim, theta)
    if rope_type == "linear":
        return _base_inv_freq(head_dim, theta) / s["factor"]  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, theta), s)  # type: ignore[arg-type]
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, s)  # type: ignore[arg-type]
    return _longrope_inv_freq(head_dim, theta, s, max_positions)  # type: ignore[arg-type]


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated, so long-context extension leaves local attention untouched.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times are kept, and a
    # linear ramp over the dimension index blends the band between.
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_inv_freq(dim: int, theta: float, s: dict[str, Any],
                       max_positions: int | None) -> torch.Tensor:
    # transformers switches lists per forward pass (long once the sequence passes the original
    # length), which would leave a paged KV cache rotated with the other list; like llama.cpp we
    # decide once per engine from the longest context it serves. So with max_positions <= the
    # original length this is transformers' short list exactly; above it every sequence uses
    # long_factor from position 0, where transformers uses short_factor until the sequence
    # passes the original length (the two differ only for those shorter sequences).
    use_long = max_positions is not None and max_positions > s["original_max_position_embeddings"]
    ext = torch.tensor(s["long_factor" if use_long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class RotaryEmbedding:
    """NeoX-style (rotate-half) RoPE over a precomputed cos/sin table indexed by position. With
    `rotary_dim` < head_dim (partial_rotary_factor) the table covers only the first rotary_dim
    dims of each head; frequencies are computed over rotary_dim, as transformers does."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        device: torch.device | str = "cpu",
        rotary_dim: int | None = None,
    ) -> None:
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], "
                             f"got {rotary_dim}")
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.attention_factor = rope_attention_factor(scaling)
        if self.attention_factor != 1.0:  # as transformers' `cos * attention_scaling`, in float32
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos = cos.to(device)  # [max_positions, rotary_dim / 2], float32
        self.sin = sin.to(device)
        self.max_positions = max_positions
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows for this step's positions, [T, 1, rotary_dim / 2]: gathered once per step and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
