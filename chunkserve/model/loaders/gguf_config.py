"""A GGUF file's metadata as a `DecoderConfig`: llama.cpp's keys, under the file's
`general.architecture` prefix (`llama.embedding_length`, `qwen3.attention.key_length`, ...).

Rope scaling that llama.cpp stores as tensors (Llama 3's `rope_freqs`, Phi-3's long/short
factors) becomes HF's `rope_scaling` dict here too (gguf_rope.py), so the model reads one form.

What llama.cpp does not store but hard-codes per architecture (Gemma 3's layer pattern, local
RoPE base and softmax scale) is written out as the config.json fields it stands for, and the
architecture's own `configure` reads them, exactly as for a HF folder (models/registry.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from chunkserve.gguf_file import GGUFFile, gguf_field
from chunkserve.model.loaders.gguf_rope import rope_scaling_from_metadata
from chunkserve.model.models.config import DecoderConfig
from chunkserve.layer_types import FULL, SLIDING
from chunkserve.model.models.registry import Architecture, gguf_architecture

# Not weights: rope scaling that llama.cpp keeps as tensors; it becomes config.
ROPE_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                          "rope_factors_short.weight"})

# llama.cpp's Gemma 3 constants (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer global,
# the local layers' RoPE base 10000, and for the 62-layer 27B a softmax scale of
# (hidden / heads)^-0.5 instead of head_dim^-0.5 (query_pre_attn_scalar 168 there).
_GEMMA3_PATTERN, _GEMMA3_LOCAL_BASE, _GEMMA3_27B_LAYERS = 6, 10000.0, 62


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def read_config(reader: GGUFFile, path: str,
                dequantize: Callable[[Any], np.ndarray]) -> DecoderConfig:
    """`dequantize`: how to read a (rope) tensor as float32 numpy."""
    arch_name = gguf_field(reader, "general.architecture")
    arch = gguf_architecture(arch_name)

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch_name}.{key}", default)

    def required(key: str) -> int:
        value = meta(key)
        if value is None:
            raise ValueError(f"{path}: GGUF file lacks the {arch_name}.{key} metadata key.")
        return int(value)

    hidden = required("embedding_length")
    n_heads = required("attention.head_count")
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    config = DecoderConfig(
        vocab_size=_vocab_size(reader, meta("vocab_size"), path),
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta("rope.freq_base", 10000.0)),
        partial_rotary_factor=int(meta("rope.dimension_count", head_dim)) / head_dim,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader, arch_name),
        architecture=arch.hf_architectures[0],
    )
    scaling = _rope_scaling(reader, config, meta, dequantize)
    if arch_name == "gemma3":
        _configure_gemma3(config, arch, meta, scaling, path)
        return config
    config.set_rope_scaling(scaling)
    # Phi-3 files state their window (0: none); up to it, full attention is exact.
    config.limit_to_window(meta("attention.sliding_window") or None)
    return config


def gemma3_hf_fields(config: DecoderConfig, meta: Callable[..., Any],
                     scaling: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """The config.json fields of a Gemma 3 GGUF: what the file stores, and what llama.cpp
    hard-codes for the architecture where it does not (`attention.sliding_window_pattern` and
    `rope.freq_base_swa` are read when a newer converter writes them)."""
    window = meta("attention.sliding_window")
    if window is None:
        raise ValueError(f"{path}: GGUF file lacks the gemma3.attention.sliding_window "
                         "metadata key.")
    n_layers = config.num_hidden_layers
    assert config.head_dim is not None
    scalar = (config.hidden_size // config.num_attention_heads
              if n_layers == _GEMMA3_27B_LAYERS else config.head_dim)
    fields: dict[str, Any] = {
        "num_hidden_layers": n_layers,
        "sliding_window": int(window),
        "rope_theta": config.rope_theta,
        "rope_local_base_freq": _f32(meta("rope.freq_base_swa", _GEMMA3_LOCAL_BASE)),
        "rope_scaling": scaling,  # llama.cpp scales the global layers' RoPE only, as HF
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": _optional_f32(meta("final_logit_softcapping")),
        "attn_logit_softcapping": _optional_f32(meta("attn_logit_softcapping")),
    }
    pattern = meta("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):  # one flag a layer, true where it slides
        fields["layer_types"] = [SLIDING if slides else FULL for slides in pattern]
    else:
        fields["sliding_window_pattern"] = int(pattern)
    return fields


def _configure_gemma3(config: DecoderConfig, arch: Architecture, meta: Callable[..., Any],
                      scaling: dict[str, Any] | None, path: str) -> None:
    """The architecture's own reading of its config.json fields, then rope scaling checked and
    the window applied, in the order models/registry.py's config_from_hf does them."""
    fields = gemma3_hf_fields(config, meta, scaling, path)
    arch.configure(config, fields)
    config.set_rope_scaling(config.rope_scaling)
    config.limit_to_window(arch.sliding_window(fields))


def _optional_f32(value: Any) -> float | None:
    return None if value is None else _f32(value)


def _rope_scaling(reader: GGUFFile, config: DecoderConfig, meta: Callable[..., Any],
                  dequantize: Callable[[Any], np.ndarray]) -> dict[str, Any] | None:
    """HF's rope_scaling dict from the file's keys and rope tensors (not yet checked)."""
    tensors = {t.name: t for t in reader.tensors if t.name in ROPE_TENSORS}

    def factors(name: str) -> np.ndarray | None:
        return dequantize(tensors[name]) if name in tensors else None

    scaling = rope_scaling_from_metadata(
        scaling_type=meta("rope.scaling.type"),
        factor=meta("rope.scaling.factor"),
        original_context=meta("rope.scaling.original_context_length"),
        freq_factors=factors("rope_freqs.weight"),
        longrope=(factors("rope_factors_short.weight"), factors("rope_factors_long.weight")),
        rope_theta=config.rope_theta,
        rotary_dim=config.rotary_dim,
    )
    return scaling


def _vocab_size(reader: GGUFFile, declared: Any, path: str) -> int:
    """{arch}.vocab_size, else the tokenizer's token count, else the embedding's rows."""
    if declared is not None:
        return int(declared)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.contents())
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(
            f"{path}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)."
        )
    return int(embd.shape[1])


# End-of-turn tokens a converter does not mark as EOT but llama.cpp stops at by their text
# (llama-vocab.cpp's end-of-generation list), and so do HF's generation_config.json files:
# Gemma 3's is eos_token_id [1, 106], <eos> and <end_of_turn>.
_END_OF_TURN_TEXT = {"gemma3": "<end_of_turn>"}


def _eos_token_ids(reader: GGUFFile, arch_name: str) -> list[int]:
    # Chat models end a turn with EOT/EOM rather than EOS; the engine must stop on all of them.
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = gguf_field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))
    text = _END_OF_TURN_TEXT.get(arch_name)
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") if text else None
    if tokens and text in tokens and tokens.index(text) not in eos_ids:
        eos_ids.append(tokens.index(text))
    return eos_ids
