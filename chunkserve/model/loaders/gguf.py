"""Reads a GGUF file (llama.cpp's format) into a `DecoderConfig` and HF-named float32 tensors.

Everything downstream (the model, the tests against transformers) speaks HF names and layouts, so
this module and gguf_config.py are the one place that knows llama.cpp's tensor names, metadata
keys and the q/k row order that llama.cpp's converter rewrites for its "llama" architecture.
What differs by architecture (that row order, Phi-3's fused names, Gemma's norm offset) is
declared by the architecture's class (models/).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import gguf
import numpy as np
import torch

from chunkserve.gguf_file import open_gguf
from chunkserve.model.loaders.lazy import LazyWeights
from chunkserve.model.loaders.gguf_config import ROPE_TENSORS, read_config
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import Architecture, architecture

GGMLType = gguf.GGMLQuantizationType

# The types `gguf.quants.dequantize` implements and that llama.cpp's usual files use. The
# list is explicit so an exotic type fails here, naming the tensor, not deep inside numpy.
SUPPORTED_TYPES = frozenset({
    GGMLType.F32, GGMLType.F16, GGMLType.BF16,
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
    GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<name>.{weight,bias} -> model.layers.N.<HF name>.{weight,bias}, for every architecture
# unless its class renames one (`gguf_renames`).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes convert_hf_to_gguf's q/k row permutation.

    llama.cpp's RoPE rotates adjacent pairs (x0, x1), HF's rotates the two halves of each head
    (x_i, x_{i+d/2}); the converter reorders each head's rows from [half0; half1] to interleaved
    so the same weights work there. Reading rows back as (head, pair, 2) and swapping to
    (head, 2, pair) restores the half-split order HF (and our model) expects.
    """
    rows = w.shape[0]
    pairs = rows // n_head // 2
    return w.reshape(n_head, pairs, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: Architecture) -> str | None:
    """The HF name of a GGUF tensor in this architecture, or None for an unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    # blk.{i}.{kind}.{weight|bias}
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        return None
    name = arch.gguf_renames.get(parts[2]) or LAYER_NAMES.get(parts[2])
    return None if name is None else f"model.layers.{int(parts[1])}.{name}.{parts[3]}"


def gguf_name(name: str, arch: Architecture) -> str:
    """The GGUF name of an HF tensor in this architecture: `hf_name` inverted, from the same
    tables (model/writers/gguf_export.py writes files that load_gguf reads back)."""
    globals_ = {hf: g for g, hf in _GLOBAL_NAMES.items()}
    if name in globals_:
        return globals_[name]
    layer = {hf: kind for kind, hf in LAYER_NAMES.items() if kind not in arch.gguf_renames}
    layer.update({hf: kind for kind, hf in arch.gguf_renames.items()})
    parts = name.split(".")
    inner = ".".join(parts[3:-1])
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or inner not in layer:
        raise ValueError(f"no GGUF name for tensor {name!r} in {arch.hf_architectures[0]}")
    return f"blk.{int(parts[2])}.{layer[inner]}.{parts[-1]}"


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's q/k row permutation (`unpermute_rope_rows` undoes it)."""
    rows = w.shape[0]
    pairs = rows // n_head // 2
    return w.reshape(n_head, 2, pairs, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_type(tensor: Any) -> GGMLType:
    qtype = GGMLType(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {qtype.name}, which is not supported "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})."
        )
    return qtype


# The `gguf` package dequantizes 16 rows a numpy pass: 64,900 passes were 10 of the 15 s of a
# Gemma 3 load (its 262,144-row embedding). Its own per-type row functions, a few thousand
# rows a pass, give the same values (tests/test_loaders.py) in a fraction of the time.
ROWS_PER_PASS = 2048


def _dequantize(tensor: Any) -> np.ndarray:
    qtype = _check_type(tensor)
    # GGUF lists dims fastest-first (ne0 = columns); numpy/torch want slowest-first, which for a
    # linear layer gives HF's [out_features, in_features].
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    traits = getattr(gguf.quants, "_type_traits", {}).get(qtype)  # block types only
    if traits is None or tensor.data.ndim == 0:
        # astype copies, so the result no longer aliases the read-only memory map.
        return gguf.quants.dequantize(tensor.data, qtype).reshape(shape).astype(
            np.float32, copy=True)
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    values = np.concatenate([traits.dequantize_rows(rows[i:i + ROWS_PER_PASS])
                             for i in range(0, rows.shape[0], ROWS_PER_PASS)])
    return values.reshape(shape)


def read_gguf_config(path: str) -> DecoderConfig:
    """The config from a GGUF file's metadata alone (`--load-format dummy`): the reader maps the
    file and parses the tensor index, but no tensor is dequantized (beyond rope tensors)."""
    return read_config(open_gguf(path), path, _dequantize)


def load_gguf(path: str) -> tuple[DecoderConfig, LazyWeights]:
    """Config and float32 tensors under HF names from a GGUF file, dequantized as taken."""
    reader = open_gguf(path)
    config = read_config(reader, path, _dequantize)
    arch = architecture(config.architecture)
    weights = LazyWeights()  # each tensor dequantized when the model takes it (loaders/lazy.py)
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r} for a "
                             f"{arch.hf_architectures[0]} model (MoE or extra layers?).")
        _check_type(tensor)  # refused at load, by name, not when the model first takes it
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weights.add(name, partial(_read_float32, tensor, name, arch, config), shape)
    return config, weights


def _read_float32(tensor: Any, name: str, arch: Architecture,
                  config: DecoderConfig) -> torch.Tensor:
    """One tensor dequantized from the file's memory map, in HF's layout."""
    return _from_gguf_values(torch.from_numpy(_dequantize(tensor)), name, arch, config)


def _from_gguf_values(t: torch.Tensor, name: str, arch: Architecture,
                      config: DecoderConfig) -> torch.Tensor:
    """A tensor as the HF checkpoint holds it: q and k rows back in HF's order where
    llama.cpp's converter reordered them, and norm weights without the offset it added.

    llama.cpp's converter folds Gemma's 1 + w into every norm weight (its RMSNorm scales by the
    weight alone), where HF stores w; the architecture adds `norm_weight_offset` back at load,
    so it is taken off here. (For weights stored from bfloat16, w' - 1 is exact in float32, so
    the model's norm weights are the file's values bit for bit.)"""
    if arch.norm_weight_offset and name.endswith("norm.weight"):
        return t - arch.norm_weight_offset
    heads = _rope_reordered_heads(name, arch, config)
    return t if heads is None else unpermute_rope_rows(t, heads)


def _rope_reordered_heads(name: str, arch: Architecture, config: DecoderConfig) -> int | None:
    """The heads of a q or k matrix whose rows llama.cpp's converter reorders, else None."""
    if not arch.gguf_qk_interleaved:
        return None
    if ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    return None


def to_gguf_values(t: torch.Tensor, name: str, arch: Architecture,
                   config: DecoderConfig) -> torch.Tensor:
    """An HF tensor as llama.cpp's converter stores it: `_from_gguf_values` inverted."""
    if arch.norm_weight_offset and name.endswith("norm.weight"):
        return t + arch.norm_weight_offset
    heads = _rope_reordered_heads(name, arch, config)
    return t if heads is None else permute_rope_rows(t, heads)
