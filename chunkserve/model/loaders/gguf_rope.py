"""Turns GGUF rope-scaling metadata back into HF's `rope_scaling` dict.

Linear and YaRN scaling are plain metadata keys. Llama-3 scaling is not: llama.cpp's converter
bakes it into a `rope_freqs` tensor of per-frequency divisors and drops the parameters. The model
only understands the HF dict, so we recover llama3 parameters that reproduce those divisors, and
refuse the file if no such parameters exist rather than run it with subtly wrong positions.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

# Divisors are stored as float32; this is far above that rounding and far below any real mismatch.
_RTOL = 1e-4


def llama3_freq_factors(
    rope_theta: float, head_dim: int, factor: float, low_freq_factor: float,
    high_freq_factor: float, original_max_position_embeddings: int,
) -> np.ndarray:
    """The divisor llama3 scaling applies to each RoPE frequency (1 = untouched)."""
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = original_max_position_embeddings
    smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen > orig / low_freq_factor, factor, medium)
    return np.where(wavelen < orig / high_freq_factor, 1.0, out)


def _fit_llama3(freq_factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    r = freq_factors.astype(np.float64)
    factor = float(r.max())
    if factor <= 1 + _RTOL:
        return None  # every divisor is 1: no scaling at all
    # x = 1 / wavelength; llama3 blends linearly in x between the "divide by factor" band (low x)
    # and the untouched band (high x): blend s = a*x - b, with a = orig/(high-low), b = low/(high-low).
    x = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    is_low = np.isclose(r, factor, rtol=_RTOL)
    is_high = np.isclose(r, 1.0, rtol=_RTOL)
    mid = ~(is_low | is_high)
    s = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        a, neg_b = np.polyfit(x[mid], s, 1)
        b = -neg_b
    else:
        # Too few blended entries to pin the line; any line passing through them that crosses
        # 0 and 1 inside the gaps between the bands gives identical divisors. Pick a steep one.
        x_lo = x[is_low].max() if is_low.any() else 0.0
        x_hi = x[is_high].min() if is_high.any() else 2 * x.max()
        if mid.sum() == 1:
            xm, sm = float(x[mid][0]), float(s[0])
        else:
            xm, sm = (x_lo + x_hi) / 2, 0.5
        a = 1.01 * max(sm / (xm - x_lo), (1 - sm) / (x_hi - xm))
        b = a * xm - sm
    # a and b fix only orig/(high-low) and low/(high-low); every released Llama 3 uses
    # low_freq_factor=1, and choosing it recovers their exact parameters (e.g. 8192, 1, 4).
    low = 1.0 if b > 0 else b
    span = low / b if b > 0 else 1.0
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": low + span,
        "original_max_position_embeddings": int(round(a * span)),
    }
    rebuilt = llama3_freq_factors(rope_theta, head_dim, factor, low, low + span, int(round(a * span)))
    if not np.allclose(rebuilt, r, rtol=10 * _RTOL):
        raise ValueError("GGUF rope_freqs tensor does not match any llama3 rope scaling; unsupported.")
    return params


def rope_scaling_from_metadata(
    scaling_type: str | None, factor: float | None, original_context: int | None,
    freq_factors: np.ndarray | None, longrope: tuple[np.ndarray | None, np.ndarray | None],
    rope_theta: float, rotary_dim: int,
) -> dict[str, Any] | None:
    """HF `rope_scaling` for a GGUF's `{arch}.rope.scaling.*` keys and its rope tensors:
    Llama 3's `rope_freqs`, Phi-3's (short, long) `rope_factors_*`."""
    if freq_factors is not None:
        if scaling_type not in (None, "none"):
            raise ValueError(f"GGUF has both rope_freqs and rope.scaling.type={scaling_type!r}.")
        if freq_factors.shape != (rotary_dim // 2,):
            raise ValueError(f"GGUF rope_freqs has shape {freq_factors.shape}, expected ({rotary_dim // 2},).")
        return _fit_llama3(freq_factors, rope_theta, rotary_dim)
    short, long = longrope
    if short is not None or long is not None:
        return _longrope(short, long, original_context)
    if scaling_type in (None, "none") or factor in (None, 1.0):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        params: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original_context is not None:
            params["original_max_position_embeddings"] = int(original_context)
        return params
    raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported.")


def _longrope(short: np.ndarray | None, long: np.ndarray | None,
              original_context: int | None) -> dict[str, Any]:
    """Phi-3's long-context scaling, which llama.cpp's converter keeps as two factor tensors and
    the original context length. (The attention factor it also stores is HF's default for
    those, which check_rope_scaling recomputes from the context lengths.)"""
    if short is None or long is None or original_context is None:
        raise ValueError("GGUF longrope scaling needs rope_factors_short, rope_factors_long and "
                         "rope.scaling.original_context_length.")
    params: dict[str, Any] = {
        "rope_type": "longrope", "short_factor": short.reshape(-1).tolist(),
        "long_factor": long.reshape(-1).tolist(),
        "original_max_position_embeddings": int(original_context),
    }
    return params
