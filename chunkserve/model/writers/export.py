"""`chunkserve export-dummy PRESET`: a preset's shape with random weights written to disk, as a
GGUF file (llama.cpp) or a HF folder (vLLM, transformers), so that a peer and chunkserve load
the same file (issue 54).

The weights are `dummy_tensors`' (the seed's normal(0, 0.02) draws in bf16, the ones
`--model PRESET` runs with), then packed into the format. The tokenizer is the bundled one
resized to the model's vocabulary (tokenizer/sized_vocab.py); bos/eos are its ids.

Nothing half-written is left behind: the files go into a sibling folder `OUT.partial-PID`,
are read back and checked (every tensor's bytes against what was written, the config as the
loaders read it, the tokenizer), and only then renamed to OUT.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import torch
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.gguf_file import open_gguf
from chunkserve.model.loaders.dummy import dummy_tensors
from chunkserve.model.loaders.gguf import gguf_name
from chunkserve.model.loaders.source import load_config
from chunkserve.model.models.checkpoint import expected_shapes
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import architecture, config_from_hf
from chunkserve.model.writers.ggml_quants import packed_nbytes
from chunkserve.model.writers.gguf_export import QUANT_MIXES, tensor_type, write_gguf
from chunkserve.model.writers.hf_export import hf_config_json, write_hf_folder
from chunkserve.presets import model_preset
from chunkserve.tokenizer.sized_vocab import SizedVocab, sized_vocab
from chunkserve.tokenizer.tokenizer import load_tokenizer

FORMATS = {"gguf": tuple(QUANT_MIXES), "hf": ("bf16",)}
DEFAULT_QUANT = {"gguf": "q4_k_m", "hf": "bf16"}
_SPARE_DISK = 1 << 30  # left free beyond the files: a full disk breaks more than this export
_CHECK_TEXT = "Hello, world! Chunked prefill splits 1234 prompts."


@dataclass(frozen=True)
class Exported:
    path: str  # the .gguf file, or the HF folder
    nbytes: int
    seconds: float


def export_dummy(preset: str, fmt: str, out: str, quant: str | None = None,
                 seed: int = 0) -> Exported:
    """Writes `preset` to `out` (a folder that does not exist, or is empty)."""
    quant = _check_args(fmt, quant, out)
    hf = model_preset(preset)  # an unknown name: ValueError listing the presets
    config = config_from_hf(hf, f"model preset {preset!r}")
    vocab = sized_vocab(config.vocab_size)
    need = estimate_bytes(config, fmt, quant)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if need + _SPARE_DISK > free:
        raise ValueError(f"{preset} as {fmt} {quant} needs {need / 2**30:.1f} GiB on disk "
                         f"(+1 GiB spare); {parent} has {free / 2**30:.1f} GiB free")
    start = time.monotonic()
    partial = f"{os.path.abspath(out)}.partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        tensors = dummy_tensors(config, seed, torch.device("cpu"), torch.bfloat16)
        name = f"{preset}-{quant}.gguf" if fmt == "gguf" else ""
        written = _write(fmt, os.path.join(partial, name), preset, hf, config, tensors, vocab,
                         quant)
        _read_back(fmt, os.path.join(partial, name), config, written, vocab)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked): replaced by the finished folder
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    path = os.path.join(out, name) if name else out
    return Exported(path, _size(out), time.monotonic() - start)


def _check_args(fmt: str, quant: str | None, out: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    quant = (quant or DEFAULT_QUANT[fmt]).lower()
    if quant not in FORMATS[fmt]:
        raise ValueError(f"quantization {quant!r} is not supported for {fmt}; "
                         f"supported: {', '.join(FORMATS[fmt])}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"{out} exists and is not an empty folder; "
                         "give a new or empty folder")
    return quant


def estimate_bytes(config: DecoderConfig, fmt: str, quant: str) -> int:
    """The weights' bytes in the file(s), from the config alone (the tokenizer aside)."""
    shapes = expected_shapes(config)
    if fmt == "hf":
        return sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    arch, mix = architecture(config.architecture), QUANT_MIXES[quant]
    return sum(packed_nbytes(s, tensor_type(gguf_name(n, arch), s, mix,
                                            config.num_hidden_layers, config.tie_word_embeddings))
               for n, s in shapes.items())


def _write(fmt: str, path: str, preset: str, hf: dict[str, Any], config: DecoderConfig,
           tensors: Iterator[tuple[str, torch.Tensor]], vocab: SizedVocab,
           quant: str) -> dict[str, int]:
    if fmt == "gguf":
        return write_gguf(path, config, tensors, vocab, quant, name=preset,
                          context_length=int(hf.get("max_position_embeddings", 2048)))
    return write_hf_folder(path, hf_config_json(hf, config, vocab), config, tensors, vocab)


def _read_back(fmt: str, path: str, config: DecoderConfig, written: dict[str, int],
               vocab: SizedVocab) -> None:
    """The file as the loaders read it: every tensor's bytes, the config, the tokenizer."""
    read = _gguf_crcs(path) if fmt == "gguf" else _hf_crcs(path)
    if read != written:
        bad = sorted(n for n in set(read) | set(written) if read.get(n) != written.get(n))
        raise RuntimeError(f"{path}: read back differs from what was written: {bad[:5]}")
    got = load_config(path)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                  "rope_scaling", "tie_word_embeddings", "architecture", "sliding_window"):
        if not _same(getattr(got, field), getattr(config, field)):
            raise RuntimeError(f"{path}: reads back with {field}={getattr(got, field)!r}, "
                               f"written {getattr(config, field)!r}")
    tokenizer = load_tokenizer(path)
    expected = _reference_ids(vocab)
    if tokenizer.encode(_CHECK_TEXT, add_special_tokens=False) != expected:
        raise RuntimeError(f"{path}: its tokenizer does not encode as the one written")


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to float32's precision: Llama 3 scaling comes back fitted from its
    float32 divisors (loaders/gguf_rope.py), 4.0000001 for 4."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(
            a, b, rel_tol=1e-6)
    return bool(a == b)


def _reference_ids(vocab: SizedVocab) -> list[int]:
    return HFTokenizer.from_str(json.dumps(vocab.tokenizer_json)).encode(
        _CHECK_TEXT, add_special_tokens=False).ids


def _gguf_crcs(path: str) -> dict[str, int]:
    reader = open_gguf(path)
    return {t.name: zlib.crc32(t.data) for t in reader.tensors}


def _hf_crcs(folder: str) -> dict[str, int]:
    from safetensors import safe_open

    crcs = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for name in handle.keys():
                crcs[name] = zlib.crc32(handle.get_tensor(name).view(torch.uint8).numpy())
    return crcs


def _size(out: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(out) for f in files)


def describe(path: str) -> str:
    """A GGUF file's tensor types, counted (for the command's summary line)."""
    if not path.endswith(".gguf"):
        return "bf16 safetensors"
    counts = Counter(gguf.GGMLQuantizationType(t.tensor_type).name
                     for t in open_gguf(path).tensors)
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
