"""Rotary position embeddings: the inverse frequencies (with HF's `rope_scaling` types) and a
cos/sin table indexed by position."""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated, so long-context extension leaves local attention untouched.
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_len / high, inv_freq, out)


class RotaryEmbedding:
    """NeoX-style (rotate-half) RoPE over a precomputed cos/sin table indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos().to(device)  # [max_positions, head_dim / 2]
        self.sin = freqs.sin().to(device)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows for this step's positions, [T, 1, head_dim / 2]: gathered once per step and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
