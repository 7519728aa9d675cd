"""Reads a llama-architecture GGUF file into a `LlamaConfig` and HF-named float32 tensors.

Everything downstream (the model, the tests against transformers) speaks HF names and layouts, so
this module is the one place that knows llama.cpp's tensor names, metadata keys and the q/k row
order that llama.cpp's converter rewrites.
"""
from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch

from chunkserve.gguf_file import gguf_field, open_gguf
from chunkserve.model.loaders.gguf_rope import rope_scaling_from_metadata
from chunkserve.model.models.config import LlamaConfig

GGMLType = gguf.GGMLQuantizationType

# The types `gguf.quants.dequantize` implements and that llama.cpp's usual llama files use. The
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
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Not weights: llama.cpp stores Llama-3 rope scaling as a precomputed tensor; it becomes config.
_ROPE_FREQS = "rope_freqs.weight"


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


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


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def _dequantize(tensor: Any) -> np.ndarray:
    qtype = GGMLType(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {qtype.name}, which is not supported "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})."
        )
    values = gguf.quants.dequantize(tensor.data, qtype)
    # GGUF lists dims fastest-first (ne0 = columns); numpy/torch want slowest-first, which for a
    # linear layer gives HF's [out_features, in_features].
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # astype copies, so the result no longer aliases the read-only memory map.
    return values.reshape(shape).astype(np.float32, copy=True)


def _read_config(reader: gguf.GGUFReader, path: str) -> LlamaConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; only 'llama' files can be loaded."
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"llama.{key}", default)

    def required(key: str) -> int:
        value = meta(key)
        if value is None:
            raise ValueError(f"{path}: GGUF file lacks the llama.{key} metadata key.")
        return int(value)

    hidden = required("embedding_length")
    n_heads = required("attention.head_count")
    n_kv_heads = meta("attention.head_count_kv", n_heads)
    head_dim = meta("attention.key_length", hidden // n_heads)
    rope_dim = meta("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported.")

    vocab_size = _vocab_size(reader, meta("vocab_size"), path)
    rope_theta = _f32(meta("rope.freq_base", 10000.0))
    max_pos = int(meta("context_length", 2048))
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    rope_scaling = rope_scaling_from_metadata(
        scaling_type=meta("rope.scaling.type"),
        factor=meta("rope.scaling.factor"),
        original_context=meta("rope.scaling.original_context_length"),
        freq_factors=None if rope_freqs is None else _dequantize(rope_freqs),
        rope_theta=rope_theta,
        head_dim=head_dim,
    )

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader),
    )


def _vocab_size(reader: gguf.GGUFReader, declared: Any, path: str) -> int:
    """llama.vocab_size, else the tokenizer's token count, else the embedding's rows."""
    if declared is not None:
        return int(declared)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(
            f"{path}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)."
        )
    return int(embd.shape[1])


def _eos_token_ids(reader: gguf.GGUFReader) -> list[int]:
    # Chat models end a turn with EOT/EOM rather than EOS; the engine must stop on all of them.
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))
    return eos_ids


def read_gguf_config(path: str) -> LlamaConfig:
    """The config from a GGUF file's metadata alone (`--load-format dummy`): the reader maps the
    file and parses the tensor index, but no tensor is dequantized (beyond a rope_freqs one)."""
    return _read_config(open_gguf(path), path)


def load_gguf(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and float32 tensors under HF Llama names from a llama-architecture GGUF file."""
    reader = open_gguf(path)
    config = _read_config(reader, path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(
                f"{path}: unexpected tensor {tensor.name!r}; this loader handles plain Llama "
                "models only (no biases, MoE or extra norms)."
            )
        weight = torch.from_numpy(_dequantize(tensor))
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        weights[name] = weight
    return config, weights
