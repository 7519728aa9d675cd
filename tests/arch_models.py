"""Tiny random-weight models of every architecture chunkserve runs, built with transformers and
saved as HF folders (safetensors + the bundled tokenizer), and the same tensors written as a
GGUF file the way llama.cpp's converter writes them. Shared by tests/test_architectures.py and
tests/test_cuda.py.

Every config uses GQA and two layers; between them the head sizes are 64, 96 and 128, and
Qwen3's head_dim is not hidden / heads. A larger init range makes greedy decoding's winners
clear, so token-identity tests compare scheduling, not floating-point coin flips.
"""
from __future__ import annotations

import gzip
import math
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from chunkserve.tokenizer.tokenizer import BUNDLED_TOKENIZER_DIR

VOCAB = 512  # ids below it are ordinary tokens of the bundled (SmolLM2) tokenizer
COMMON = dict(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

# name -> (transformers config class, model class, fields); head sizes in the comments.
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",  # 64, tied embeddings
              dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                   rope_theta=10000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM",  # 128; the window is past the context
                dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                     sliding_window=4096, rope_theta=1e6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",  # 64, q/k/v biases
              dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                   rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",  # 128 = head_dim, hidden / heads = 32
              dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                   rope_theta=1e6)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",  # 96, fused qkv_proj / gate_up_proj on disk
             dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                  original_max_position_embeddings=512, pad_token_id=0)),
}
# Rope variants, checked against transformers on the same architectures.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-longrope": ("phi3", dict(  # short factors apply: max_model_len <= the original 256
        max_position_embeddings=1024, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 40 for i in range(48)],
                      "long_factor": [2.0 + i / 10 for i in range(48)]})),
    "phi3-partial-rotary": ("phi3", dict(partial_rotary_factor=0.75)),  # Phi-4-mini's
    "qwen2-yarn": ("qwen2", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
}

# Architectures with sliding-window layers (KV-cache groups), tested in tests/test_gemma3.py on
# prompts several windows long. Window 32; local and global layers; the attention scale's
# scalar differs from head_dim so that a scale left at head_dim^-0.5 shows.
WINDOWED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(  # head_dim 32 = hidden / heads
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_hidden_layers=3, sliding_window=32, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True, pad_token_id=0)),
}
WINDOWED_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-256": ("gemma3", dict(head_dim=256)),  # the real models' head size
    # Gemma 3 4B's linear scaling of the global layers' RoPE, and logit softcapping.
    "gemma3-linear": ("gemma3", dict(
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=3.0)),
}


def hf_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers model of architecture `name` (an ARCHS or VARIANTS key), config
    fields changed by `overrides`."""
    import transformers

    base, changes = {**VARIANTS, **WINDOWED_VARIANTS}.get(name, (name, {}))
    config_cls, model_cls, fields = {**ARCHS, **WINDOWED}[base]
    config = getattr(transformers, config_cls)(**{**COMMON, **fields, **changes, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    # transformers starts biases at 0 and norm weights at 1, which would hide a bias or a norm
    # weight that is never applied: both get random values.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif param_name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    return model


def write_bundled_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer (chunkserve/data/tokenizer) as tokenizer.json + tokenizer_config.json."""
    with gzip.open(Path(BUNDLED_TOKENIZER_DIR) / "tokenizer.json.gz", "rb") as src:
        (folder / "tokenizer.json").write_bytes(src.read())
    shutil.copy(Path(BUNDLED_TOKENIZER_DIR) / "tokenizer_config.json", folder)


def save_hf_folder(model: Any, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_bundled_tokenizer(folder)
    return folder


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row reorder for its "llama" architecture (the loader inverts it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer: gguf.GGUFWriter, cfg: Any, head_dim: int) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rotary = int(head_dim * (getattr(cfg, "partial_rotary_factor", None) or 1.0))
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    _rope_metadata(writer, cfg)


def _rope_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Rope scaling as llama.cpp's converter writes it: YaRN as keys, Phi-3's longrope as
    two factor tensors beside the original context length."""
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope.get("rope_type") == "longrope":
        original = cfg.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))


def write_gguf(model: Any, path: Path, arch: str, extra_metadata: dict[str, Any] | None = None) -> None:
    """The model's float32 tensors as a GGUF of llama.cpp architecture `arch` (llama, qwen2,
    qwen3, phi3), named by gguf-py's own HF -> GGUF name map (llama.cpp's, not chunkserve's),
    with q/k rows reordered for "llama" as llama.cpp's converter does, and no tokenizer unless
    `extra_metadata` brings one (key -> value, strings and lists of strings/ints)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, cfg, head_dim)
    for key, value in (extra_metadata or {}).items():
        _add_value(writer, key, value)
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, tensor in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            w = llamacpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, list) and value and isinstance(value[0], str):
        writer.add_array(key, value)
    elif isinstance(value, list):
        writer.add_array(key, [int(v) for v in value])
    else:
        raise TypeError(f"{key}: {type(value)}")


def smollm2_tokenizer_metadata(smollm2_path: str) -> dict[str, Any]:
    """The default model's GGUF tokenizer keys (byte-level BPE), to give a test GGUF a real
    tokenizer."""
    from chunkserve.gguf_file import gguf_field, open_gguf

    reader = open_gguf(smollm2_path)
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    return {key: gguf_field(reader, key) for key in keys}
