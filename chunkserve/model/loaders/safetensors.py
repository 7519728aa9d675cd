"""Reads a Hugging Face checkpoint folder (config.json + *.safetensors) of a Llama-shaped model."""
from __future__ import annotations

import json
import os
from glob import glob

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from chunkserve.model.models.config import LlamaConfig

# model_types whose checkpoints are exactly Llama's tensors and maths (Mistral differs only by
# its sliding window, handled below).
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    return sorted(glob(os.path.join(path, "*.safetensors")))


def _read_config(path: str) -> LlamaConfig:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{path}: Llama variants with attention/MLP biases are not supported.")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only silu).")
    try:
        config = LlamaConfig.from_hf_dict(raw)
    except KeyError as e:
        raise ValueError(f"{path}: config.json lacks {e.args[0]!r}.") from None
    window = raw.get("sliding_window")
    if window is not None and window < config.max_position_embeddings:
        # Up to the window, sliding-window attention is full attention; capping the context
        # keeps the model exact instead of silently attending too far back.
        config.max_position_embeddings = int(window)
    return config


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


def read_hf_config(path: str) -> LlamaConfig:
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


def load_hf_dir(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and float32 tensors under HF Llama names from a checkpoint folder."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: not a Hugging Face model folder (no config.json).")
    files = _safetensors_files(path)
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported).")
    config = read_hf_config(path)

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file, device="cpu").items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a derived buffer some old checkpoints saved; we recompute it
            if not name.startswith(("model.", "lm_head.")):
                name = f"model.{name}"  # saved from the bare LlamaModel, without the LM wrapper
            weights[name] = tensor.to(torch.float32)
    return config, weights
