"""Hardware and model descriptions for the simulator, from the TOML presets or a config.json.

Hardware presets live beside this module; model presets are shared with the engine's loader
(chunkserve/presets.py).

A model that says which of its layers use a sliding window (Gemma 3's `layer_types`, or its
older `sliding_window_pattern`) carries one window per layer: its KV-cache groups
(core/kv_groups.py) and its attention cost follow them. One that only names a window (Mistral,
Phi-3, Qwen2's disabled one) is simulated with full attention, as before.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from chunkserve.core.kv_groups import KVCacheGroups, group_layers
from chunkserve.layer_types import SLIDING, layer_types
from chunkserve.presets import model_preset, model_preset_names

_DATA = os.path.join(os.path.dirname(__file__), "data")
# (window, number of layers) per kind of attention layer, full attention (None) first.
AttentionLayers = tuple[tuple[int | None, int], ...]


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_tflops: float  # dense bf16
    hbm_gbps: float
    memory_gib: float
    launch_us: float = 4.0
    link_gbps: float = 300.0
    gemm_tile: int = 128
    # Typical fractions of peak reached by serving kernels (not datasheet values).
    gemm_efficiency: float = 0.7
    gemm_half_tokens: float = 64.0  # GEMM rows at which efficiency reaches half its maximum
    attention_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.85
    kernels_per_layer: int = 12
    step_overhead_ms: float = 2.0  # scheduling, input preparation, sampling: CPU side
    request_overhead_us: float = 10.0
    # The article's second failure: prefill and decode sharing one attention call run slower.
    mixed_batch_penalty: float = 0.25
    allreduce_latency_us: float = 10.0
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 2.0

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        return self.hbm_gbps * 1e9


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    dtype_bytes: int = 2  # bf16 weights (and KV, unless kv_dtype_bytes says otherwise)
    kv_dtype_bytes: int | None = None  # 1: an fp8 KV cache (--kv-cache-dtype fp8)
    # Per layer: its sliding window, None for full attention; None: every layer full.
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's linear layers (q, k, v, o, gate, up, down)."""
        q = self.hidden_size * self.num_attention_heads * self.dim
        kv = 2 * self.hidden_size * self.num_key_value_heads * self.dim
        o = self.num_attention_heads * self.dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q + kv + o + mlp

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.head_params
        return (self.layer_params * self.num_hidden_layers + embed + head) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_of(self.num_hidden_layers)

    def kv_bytes_per_token_of(self, layers: int) -> int:
        """K and V of one token in `layers` layers."""
        elem = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * layers * self.num_key_value_heads * self.dim * elem

    @cached_property  # read by every simulated step's cost
    def attention_layers(self) -> AttentionLayers:
        """How many layers attend how far: ((None, L),) for a model without windows."""
        if self.layer_windows is None:
            return ((None, self.num_hidden_layers),)
        counts: dict[int | None, int] = {}
        for window in self.layer_windows:
            counts[window] = counts.get(window, 0) + 1
        return tuple(sorted(counts.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)))

    def kv_cache_groups(self, max_model_len: int) -> KVCacheGroups | None:
        """The engine's KV-cache groups for this model at `max_model_len`; None (one group of
        every layer, what SimConfig assumes without groups) when no window slides within the
        context, as the engine's model decides (models/gemma3.py layer_windows)."""
        windows = self.layer_windows
        if windows is None or all(w is None or w >= max_model_len for w in windows):
            return None
        return group_layers(list(windows))


def _load(file: str) -> dict[str, dict[str, Any]]:
    with open(os.path.join(_DATA, file), "rb") as f:
        return tomllib.load(f)


def hardware_names() -> list[str]:
    return sorted(_load("hardware.toml"))


def model_names() -> list[str]:
    return model_preset_names()


def get_hardware(name: str) -> HardwareSpec:
    presets = _load("hardware.toml")
    if name not in presets:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(sorted(presets))} "
                         "(or a profile file written by `chunkserve profile`)")
    return HardwareSpec(name=name, **presets[name])


def get_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a path to a HF config.json (or a folder holding one)."""
    if name_or_path in model_preset_names():
        return _spec_from_hf(name_or_path, model_preset(name_or_path), "preset " + name_or_path)
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {name_or_path!r}; presets: "
                         f"{', '.join(model_preset_names())}, or a path to a HF config.json")
    with open(path) as f:
        cfg = json.load(f)
    return _spec_from_hf(os.path.basename(os.path.dirname(os.path.abspath(path))), cfg, path)


def profiled_kv_groups(model: str, max_model_len: int) -> KVCacheGroups | None:
    """The KV-cache groups of a profiled (or validated) model, whose `num_kv_blocks` the engine
    sized by them. None for a model whose shape the simulator cannot read (a GGUF file has no
    config.json here): one group, as the simulator has always assumed."""
    try:
        return get_model(model).kv_cache_groups(max_model_len)
    except ValueError:
        return None


def _spec_from_hf(name: str, cfg: dict[str, Any], source: str) -> ModelSpec:
    # Only the shape fields: a config.json (or a preset, which also carries what the engine needs
    # to run the model: rope_theta, eps, token ids) has many keys the simulator has no use for.
    keys = {f.name for f in fields(ModelSpec)} - {"name", "dtype_bytes", "kv_dtype_bytes",
                                                    "layer_windows"}
    try:
        values = {k: cfg[k] for k in keys if k in cfg}
        values.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        return ModelSpec(name=name, layer_windows=_layer_windows(cfg), **values)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: not a Llama-style config.json ({e})") from None


def _layer_windows(cfg: dict[str, Any]) -> tuple[int | None, ...] | None:
    """Each layer's window, for a config that says which layers slide (layer_types.py's rule,
    the model code's). None: every layer full attention."""
    window = cfg.get("sliding_window")
    says = ({"layer_types", "sliding_window_pattern", "_sliding_window_pattern"} & set(cfg)
            or "Gemma3ForCausalLM" in (cfg.get("architectures") or []))
    if window is None or not says:
        return None
    types = layer_types(cfg)
    if SLIDING not in types:
        return None
    if int(window) < 1:
        raise ValueError(f"sliding_window must be positive, got {window}")
    return tuple(int(window) if t == SLIDING else None for t in types)
