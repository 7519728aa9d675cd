"""A model written as a GGUF file, tensor by tensor, in the type mixes llama-quantize makes.

The writer streams: every tensor's name, type and size goes into the header first (they follow
from the config alone), then each tensor is packed and written as it arrives and dropped, so the
peak is one tensor (an 8B model's 1 GB embedding), not the model. What the file says is what
load_gguf reads back: names and q/k row order from loaders/gguf.py's tables (inverted), config
keys under the architecture's prefix, Llama 3 RoPE scaling as a `rope_freqs` tensor.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from chunkserve.model.loaders.gguf import gguf_name, to_gguf_values
from chunkserve.model.loaders.gguf_rope import llama3_freq_factors
from chunkserve.model.models.checkpoint import expected_shapes
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import Architecture, architecture
from chunkserve.model.writers.ggml_quants import (ROWS_PER_PASS, GGMLType, packed_nbytes,
                                                  quantize_rows)
from chunkserve.tokenizer.sized_vocab import SizedVocab

FileType = gguf.LlamaFileType


@dataclass(frozen=True)
class QuantMix:
    """A llama-quantize file type: the linears' type, the output matrix's (llama.cpp keeps it
    at Q6_K in 4-bit files: its error costs the most), and Q4_K_M's extra bits."""
    file_type: FileType
    base: GGMLType
    output: GGMLType
    more_bits: GGMLType | None = None  # attn_v and ffn_down of some layers (Q4_K_M: Q6_K)


QUANT_MIXES: dict[str, QuantMix] = {
    "q4_0": QuantMix(FileType.MOSTLY_Q4_0, GGMLType.Q4_0, GGMLType.Q6_K),
    "q4_k_m": QuantMix(FileType.MOSTLY_Q4_K_M, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q6_K),
    "q8_0": QuantMix(FileType.MOSTLY_Q8_0, GGMLType.Q8_0, GGMLType.Q8_0),
    "f16": QuantMix(FileType.MOSTLY_F16, GGMLType.F16, GGMLType.F16),
    "bf16": QuantMix(FileType.MOSTLY_BF16, GGMLType.BF16, GGMLType.BF16),
}
# llama.cpp's fallbacks for rows that are not whole k-quant super-blocks (llama-quant.cpp).
_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q6_K: GGMLType.Q8_0}


def _use_more_bits(layer: int, n_layers: int) -> bool:
    # llama-quant.cpp's use_more_bits: the first and last eighth, and every third in between.
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def tensor_type(name: str, shape: tuple[int, ...], mix: QuantMix, n_layers: int,
                tied: bool) -> GGMLType:
    """The type llama-quantize gives GGUF tensor `name` of HF `shape` in this mix."""
    if len(shape) == 1:
        return GGMLType.F32  # norms and biases
    qtype = mix.base
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = mix.output
    elif mix.more_bits is not None and name.startswith("blk."):
        _, layer, kind, _ = name.split(".")
        if kind in ("attn_v", "ffn_down") and _use_more_bits(int(layer), n_layers):
            qtype = mix.more_bits
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        qtype = _FALLBACK.get(qtype, GGMLType.F16)
        if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = GGMLType.F16
    return qtype


def gguf_arch_name(arch: Architecture) -> str:
    """What llama.cpp's converter writes as general.architecture (Mistral's files say llama)."""
    return next(c.gguf_architectures[0] for c in arch.__mro__
                if getattr(c, "gguf_architectures", ()))


def _refuse_unwritable(config: DecoderConfig, arch: Architecture) -> None:
    if arch.norm_weight_offset or config.layer_types is not None:
        raise ValueError(f"GGUF export of {config.architecture} is not supported (its layer "
                         "pattern is llama.cpp's hard-coded knowledge); use --format hf")
    kind = (config.rope_scaling or {}).get("rope_type")
    if kind not in (None, "llama3", "linear"):
        raise ValueError(f"GGUF export of rope scaling {kind!r} is not supported; "
                         "use --format hf")


def _metadata(w: gguf.GGUFWriter, config: DecoderConfig, name: str, context_length: int,
              mix: QuantMix, vocab: SizedVocab) -> None:
    assert config.head_dim is not None
    w.add_name(name)
    w.add_file_type(int(mix.file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(config.vocab_size)
    w.add_context_length(context_length)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.rotary_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.sliding_window is not None:
        w.add_sliding_window(config.sliding_window)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    fields = vocab.gguf_fields()
    w.add_tokenizer_model(fields["model"])
    w.add_tokenizer_pre(fields["pre"])
    w.add_token_list(fields["tokens"])
    w.add_token_types(fields["token_type"])
    w.add_token_merges(fields["merges"])
    w.add_bos_token_id(fields["bos_token_id"])
    w.add_eos_token_id(fields["eos_token_id"])
    w.add_add_bos_token(fields["add_bos_token"])
    if fields["chat_template"]:
        w.add_chat_template(fields["chat_template"])


def _rope_freqs(config: DecoderConfig) -> np.ndarray | None:
    """Llama 3 scaling as llama.cpp's converter bakes it: one divisor per frequency."""
    s = config.rope_scaling or {}
    if s.get("rope_type") != "llama3":
        return None
    return llama3_freq_factors(config.rope_theta, config.rotary_dim, s["factor"],
                               s["low_freq_factor"], s["high_freq_factor"],
                               s["original_max_position_embeddings"]).astype(np.float32)


def _pack(t: torch.Tensor, qtype: GGMLType) -> np.ndarray:
    """A tensor as `qtype`, a slice of rows at a time (bounded float32 temporaries)."""
    rows = t.reshape(-1, t.shape[-1])
    parts = [quantize_rows(rows[i:i + ROWS_PER_PASS].float().numpy(), qtype)
             for i in range(0, rows.shape[0], ROWS_PER_PASS)]
    return np.concatenate(parts).reshape(*t.shape[:-1], -1)


def write_gguf(path: str, config: DecoderConfig, tensors: Iterable[tuple[str, torch.Tensor]],
               vocab: SizedVocab, quant: str, name: str, context_length: int) -> dict[str, int]:
    """Writes `tensors` (HF names, in expected_shapes' order) to `path`; returns each GGUF
    tensor's CRC-32, for the read-back check (export.py)."""
    mix = QUANT_MIXES[quant]
    arch = architecture(config.architecture)
    _refuse_unwritable(config, arch)
    shapes = expected_shapes(config)
    writer = gguf.GGUFWriter(path, gguf_arch_name(arch))
    _metadata(writer, config, name, context_length, mix, vocab)
    freqs = _rope_freqs(config)
    if freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", freqs.shape, np.float32, freqs.nbytes,
                               GGMLType.F32)
    types: dict[str, GGMLType] = {}
    for hf, shape in shapes.items():
        g = gguf_name(hf, arch)
        types[hf] = tensor_type(g, shape, mix, config.num_hidden_layers,
                                config.tie_word_embeddings)
        writer.add_tensor_info(g, shape, np.float32, packed_nbytes(shape, types[hf]), types[hf])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    crcs: dict[str, int] = {}
    order = iter(shapes)  # the header's order, which the data must follow
    if freqs is not None:
        writer.write_tensor_data(freqs)
        crcs["rope_freqs.weight"] = zlib.crc32(freqs.tobytes())
    for hf, tensor in tensors:
        if next(order, None) != hf or tuple(tensor.shape) != shapes[hf]:
            raise ValueError(f"tensor {hf} {tuple(tensor.shape)} is not the next of "
                             "expected_shapes' tensors")
        data = _pack(to_gguf_values(tensor, hf, arch, config), types[hf])
        writer.write_tensor_data(data)
        crcs[gguf_name(hf, arch)] = zlib.crc32(data.tobytes())
    writer.close()
    return crcs
