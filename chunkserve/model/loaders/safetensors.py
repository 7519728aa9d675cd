"""Reads a Hugging Face checkpoint folder (config.json + *.safetensors) of any architecture in
models/registry.py."""
from __future__ import annotations

import json
import os
from functools import partial
from glob import glob
from typing import Any

import torch
from safetensors import safe_open

from chunkserve.model.loaders.lazy import LazyWeights

from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import config_from_hf


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    return sorted(glob(os.path.join(path, "*.safetensors")))


def _read_config(path: str) -> DecoderConfig:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    config = config_from_hf(raw, path)
    # Chat models list the end of a turn among generation_config.json's EOS ids, not always in
    # config.json (Phi-3: <|end|>); vLLM stops on both, so do we.
    for eos in _generation_eos_ids(path):
        if eos not in config.eos_token_ids:
            config.eos_token_ids.append(eos)
    return config


def _generation_eos_ids(path: str) -> list[int]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return []
    with open(file, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [int(e) for e in ([eos] if isinstance(eos, int) else eos)]


def _tensor_names(path: str, files: list[str]) -> set[str]:
    # Only the names: from the shard index, or from each file's header (no tensor is read).
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return set(json.load(f)["weight_map"])
    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def read_hf_config(path: str) -> DecoderConfig:
    """The config of a checkpoint folder, without reading its weights (`--load-format dummy`).

    A folder with config.json alone is enough; safetensors files, if any, settle tying.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a Hugging Face model folder (no config.json).")
    config = _read_config(path)
    files = _safetensors_files(path)
    if files:
        # The head decides tying, not the config flag: a file without lm_head can only be tied,
        # and one that has it is used as-is (equal to the embedding anyway when the config says
        # tied).
        config.tie_word_embeddings = "lm_head.weight" not in _tensor_names(path, files)
    return config


def load_hf_dir(path: str) -> tuple[DecoderConfig, LazyWeights]:
    """Config and float32 tensors under HF names from a checkpoint folder, read as taken."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a Hugging Face model folder (no config.json).")
    files = _safetensors_files(path)
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported).")
    config = read_hf_config(path)

    weights = LazyWeights()  # each tensor read when the model takes it (loaders/lazy.py)
    for file in files:
        handle = safe_open(file, framework="pt")
        for stored in handle.keys():
            if stored.endswith("rotary_emb.inv_freq"):
                continue  # a derived buffer some old checkpoints saved; we recompute it
            name = stored
            if not name.startswith(("model.", "lm_head.")):
                name = f"model.{name}"  # saved from the bare decoder model, without the LM wrapper
            shape = tuple(handle.get_slice(stored).get_shape())
            weights.add(name, partial(_read_float32, handle, stored), shape)
    return config, weights


def _read_float32(handle: Any, name: str) -> torch.Tensor:
    return handle.get_tensor(name).to(torch.float32)
