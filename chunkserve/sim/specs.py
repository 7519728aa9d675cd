"""Hardware and model descriptions for the simulator, from the TOML presets or a config.json.

Hardware presets live beside this module; model presets are shared with the engine's loader
(chunkserve/presets.py).
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, fields
from typing import Any

from chunkserve.presets import model_preset, model_preset_names

_DATA = os.path.join(os.path.dirname(__file__), "data")


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
        elem = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.dim * elem


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


def _spec_from_hf(name: str, cfg: dict[str, Any], source: str) -> ModelSpec:
    # Only the shape fields: a config.json (or a preset, which also carries what the engine needs
    # to run the model: rope_theta, eps, token ids) has many keys the simulator has no use for.
    keys = {f.name for f in fields(ModelSpec)} - {"name", "dtype_bytes", "kv_dtype_bytes"}
    try:
        values = {k: cfg[k] for k in keys if k in cfg}
        values.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        return ModelSpec(name=name, **values)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: not a Llama-style config.json ({e})") from None
