"""A model written as a Hugging Face folder: config.json, bf16 safetensors shards with their
index (as `save_pretrained` shards), tokenizer.json and tokenizer_config.json.

The shards are planned from the config alone (each tensor's size is known), so each shard is
written with safetensors as soon as its tensors have arrived and then dropped: the peak is one
shard, not the model.
"""
from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import save_file

from chunkserve.model.models.checkpoint import expected_shapes
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import architecture
from chunkserve.tokenizer.sized_vocab import SizedVocab

SHARD_BYTES = 2 << 30  # what transformers' save_pretrained uses by default (max_shard_size 2GB)
DTYPE = torch.bfloat16


def _file_mode() -> int:
    """What open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def plan_shards(config: DecoderConfig) -> list[list[str]]:
    """Tensor names by shard, in order, each shard under SHARD_BYTES unless one tensor is."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in expected_shapes(config).items():
        nbytes = DTYPE.itemsize
        for d in shape:
            nbytes *= d
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def hf_config_json(preset: dict[str, Any], config: DecoderConfig,
                   vocab: SizedVocab) -> dict[str, Any]:
    """The preset's config.json fields, with what a loader needs that a preset leaves out
    (model_type, torch_dtype) and the token ids of the tokenizer that travels with it."""
    arch = architecture(config.architecture)
    return {**preset, "model_type": arch.hf_model_types[0], "torch_dtype": "bfloat16",
            "bos_token_id": vocab.bos_token_id, "eos_token_id": vocab.eos_token_id}


def write_hf_folder(out: str, config_json: dict[str, Any], config: DecoderConfig,
                    tensors: Iterable[tuple[str, torch.Tensor]],
                    vocab: SizedVocab) -> dict[str, int]:
    """Writes the folder's files into `out` (an empty folder); returns each tensor's CRC-32
    of its bf16 bytes, for the read-back check."""
    shards = plan_shards(config)
    where = {name: i for i, names in enumerate(shards) for name in names}
    pending: dict[str, torch.Tensor] = {}
    crcs: dict[str, int] = {}
    current = 0
    for name, tensor in tensors:
        if where.get(name) != current or name in pending:
            raise ValueError(f"tensor {name} arrived out of expected_shapes' order")
        pending[name] = tensor.to(DTYPE).contiguous()
        crcs[name] = zlib.crc32(pending[name].view(torch.uint8).numpy().tobytes())
        if len(pending) == len(shards[current]):
            path = os.path.join(out, shard_file(current, len(shards)))
            save_file(pending, path, metadata={"format": "pt"})
            os.chmod(path, _file_mode())  # safetensors leaves 0600: readable by its owner only
            pending, current = {}, current + 1
    if current != len(shards):
        raise ValueError(f"only {current} of {len(shards)} shards' tensors arrived")
    if len(shards) > 1:
        total = sum(DTYPE.itemsize * int(torch.Size(s).numel())
                    for s in expected_shapes(config).values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: shard_file(where[n], len(shards)) for n in where}}
        _write_json(os.path.join(out, "model.safetensors.index.json"), index)
    _write_json(os.path.join(out, "config.json"), config_json)
    _write_json(os.path.join(out, "tokenizer.json"), vocab.tokenizer_json)
    _write_json(os.path.join(out, "tokenizer_config.json"), vocab.tokenizer_config)
    return crcs


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
