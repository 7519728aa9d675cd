"""A config's `rope_scaling` dict, checked and normalized: supported types default, linear,
llama3, yarn, longrope ("su" is longrope's old name), each with every key the rotary table
(rotary.py) reads, transformers' defaults filled in. `check_rope_scaling` runs once, when a
model's config is read, so a type that is not built is refused then, by name."""
from __future__ import annotations

import math
from typing import Any


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


def normalize_rope_scaling(scaling: dict[str, Any] | None, max_position_embeddings: int | None,
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
    return normalize_rope_scaling(scaling, max_position_embeddings,
                                  original_max_position_embeddings,
                      rotary_dim)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor multiplying cos and sin (YaRN's and LongRoPE's "mscale"); 1 for other types."""
    s = normalize_rope_scaling(scaling, None, None, None)
    return 1.0 if s is None else float(s.get("attention_factor", 1.0))
