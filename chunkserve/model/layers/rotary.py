"""Rotary position embeddings: the inverse frequencies (with HF's `rope_scaling` types) and a
cos/sin table indexed by position.

Supported `rope_scaling` types: default, linear, llama3, yarn, longrope ("su" is longrope's old
name). `check_rope_scaling` validates and normalizes a config's dict once, at config-parse time;
the table code below reads only normalized keys (and normalizes a raw dict itself when it is
complete). Frequencies are computed in float32 with the same operations, in the same order, as
transformers, so the tables equal its cos/sin bit for bit (tests/test_rotary.py checks each
type): parity with the reference matters more here than the last ulp of exactness."""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_SUPPORTED = "supported rope_scaling types: " + ", ".join(SUPPORTED_ROPE_TYPES)


def _error(msg: str) -> ValueError:
    return ValueError(f"{msg} ({_SUPPORTED})")


def _rope_type(s: dict[str, Any]) -> str:
    """The canonical type name. Older configs say "type"; Phi-3's first long-context configs
    said "su", and some said "yarn" while carrying LongRoPE's factor lists (transformers'
    Phi3Config renames both to longrope). Real YaRN never has short/long factor lists."""
    name = s.get("rope_type", s.get("type", "default"))
    if name == "su" or (name == "yarn" and "short_factor" in s and "long_factor" in s):
        return "longrope"
    if name not in SUPPORTED_ROPE_TYPES:
        raise _error(f"unsupported rope_scaling type {name!r}")
    return name


def _positive(value: Any, key: str, rope_type: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _error(f"rope_scaling type {rope_type!r} needs {key!r} as a number > 0, "
                     f"got {value!r}")
    return float(value)


def _number(s: dict[str, Any], key: str, rope_type: str) -> float:
    return _positive(s.get(key), key, rope_type)


def _nonzero(s: dict[str, Any], key: str, rope_type: str) -> float:
    # llama3's band edges: any sign (the GGUF loader's fit may produce low <= 0), not zero
    # (they divide the original length).
    value = s.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        raise _error(f"rope_scaling type {rope_type!r} needs {key!r} as a nonzero number, "
                     f"got {value!r}")
    return float(value)


def _factor_list(s: dict[str, Any], key: str, rotary_dim: int | None) -> list[float]:
    value = s.get(key)
    if not isinstance(value, (list, tuple)) or not value or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value
    ):
        raise _error(f"rope_scaling type 'longrope' needs {key!r} as a list of numbers > 0")
    if rotary_dim is not None and len(value) != rotary_dim // 2:
        raise _error(f"rope_scaling {key!r} has {len(value)} entries; the rotary dimension "
                     f"{rotary_dim} needs {rotary_dim // 2} (one per frequency)")
    return [float(x) for x in value]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _normalize_yarn(s: dict[str, Any], factor: float | None, original: int) -> dict[str, Any]:
    # transformers: beta defaults via `or` (so 0 also means default); the attention factor is the
    # dict's, else mscale/mscale_all_dim's ratio when both are truthy (DeepSeek), else 0.1 ln(s)+1.
    if factor is None:
        factor = _number(s, "factor", "yarn")
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    truncate = s.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _error(f"rope_scaling 'truncate' must be true or false, got {truncate!r}")
    beta_fast = _positive(s.get("beta_fast") or 32, "beta_fast", "yarn")
    beta_slow = _positive(s.get("beta_slow") or 1, "beta_slow", "yarn")
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": truncate,
            "attention_factor": _positive(attention, "attention_factor", "yarn")}


def _normalize_longrope(s: dict[str, Any], factor: float | None, original: int,
                        rotary_dim: int | None) -> dict[str, Any]:
    short = _factor_list(s, "short_factor", rotary_dim)
    long = _factor_list(s, "long_factor", rotary_dim)
    if len(short) != len(long):
        raise _error(f"rope_scaling 'short_factor' ({len(short)}) and 'long_factor' ({len(long)}) "
                     "must have the same length")
    if factor is None:
        factor = _number(s, "factor", "longrope")
    attention = s.get("attention_factor")
    if attention is None:  # transformers' default, from the context extension ratio
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": original, "factor": factor,
            "attention_factor": _positive(attention, "attention_factor", "longrope")}


def _original_length(s: dict[str, Any], rope_type: str, max_position_embeddings: int | None,
                     override: int | None) -> int:
    # A top-level original_max_position_embeddings (Phi-3) wins over the dict's, as in transformers.
    value = override if override is not None else s.get("original_max_position_embeddings")
    if value is None:
        value = max_position_embeddings
    if value is None:
        raise _error(f"rope_scaling type {rope_type!r} needs 'original_max_position_embeddings'; "
                     "pass the dict through check_rope_scaling(scaling, max_position_embeddings)")
    return int(_positive(value, "original_max_position_embeddings", rope_type))


def _normalize(scaling: dict[str, Any] | None, max_position_embeddings: int | None,
               original_max_position_embeddings: int | None,
               rotary_dim: int | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise _error(f"rope_scaling must be a dict or null, got {type(scaling).__name__}")
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": _number(scaling, "factor", "linear")}
    original = _original_length(scaling, rope_type, max_position_embeddings,
                                original_max_position_embeddings)
    if rope_type == "llama3":
        low = _nonzero(scaling, "low_freq_factor", "llama3")
        high = _nonzero(scaling, "high_freq_factor", "llama3")
        if high <= low:
            raise _error("llama3 rope_scaling needs high_freq_factor > low_freq_factor, "
                         f"got {high} <= {low}")
        return {"rope_type": "llama3", "factor": _number(scaling, "factor", "llama3"),
                "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original}
    # yarn and longrope: a missing (or null) factor is the context extension ratio, as in
    # transformers (Phi-3 and DeepSeek-V3 configs give only the two lengths).
    factor = None
    if scaling.get("factor") is None:
        if max_position_embeddings is None:
            raise _error(f"rope_scaling type {rope_type!r} needs 'factor' (or "
                         "max_position_embeddings to derive it); pass the dict through "
                         "check_rope_scaling first")
        factor = max_position_embeddings / original
    if rope_type == "yarn":
        return _normalize_yarn(scaling, factor, original)
    return _normalize_longrope(scaling, factor, original, rotary_dim)


def check_rope_scaling(
    scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    original_max_position_embeddings: int | None = None,
    rotary_dim: int | None = None,
) -> dict[str, Any] | None:
    """Validates a config's `rope_scaling` (or transformers 5 `rope_parameters`) dict and returns
    a normalized copy with every key the table needs, or None for plain RoPE. Raises ValueError
    for unsupported types or missing/malformed keys. `original_max_position_embeddings` is a
    top-level config value (Phi-3) that overrides the dict's; `rotary_dim` (head_dim times
    partial_rotary_factor) enables the longrope list-length check. Keys the table does not use
    (rope_theta, partial_rotary_factor, mscale after resolving it) are dropped: read them from
    the config."""
    return _normalize(scaling, max_position_embeddings, original_max_position_embeddings,
                      rotary_dim)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor multiplying cos and sin (YaRN's and LongRoPE's "mscale"); 1 for other types."""
    s = _normalize(scaling, None, None, None)
    return 1.0 if s is None else float(s.get("attention_factor", 1.0))


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """float32 inverse frequencies over `head_dim` (pass the rotary dim for partial rotary).
    `max_positions` (the longest context the engine serves) picks LongRoPE's factor list."""
    s = _normalize(scaling, None, None, head_dim)
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
