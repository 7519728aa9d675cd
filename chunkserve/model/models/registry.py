"""Which class runs a checkpoint: config.json `architectures` (or `model_type`) and GGUF
`general.architecture` names, mapped to the architectures in this folder; and a config.json
turned into a `DecoderConfig` with what its architecture declares applied."""
from __future__ import annotations

from typing import Any

from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.gemma3 import Gemma3ForCausalLM
from chunkserve.model.models.llama import LlamaForCausalLM
from chunkserve.model.models.mistral import MistralForCausalLM
from chunkserve.model.models.phi3 import Phi3ForCausalLM
from chunkserve.model.models.qwen2 import Qwen2ForCausalLM
from chunkserve.model.models.qwen3 import Qwen3ForCausalLM

Architecture = type[LlamaForCausalLM]
ARCHITECTURES: tuple[Architecture, ...] = (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
    Gemma3ForCausalLM,
)
_BY_HF = {name: arch for arch in ARCHITECTURES for name in arch.hf_architectures}
_BY_MODEL_TYPE = {name: arch for arch in ARCHITECTURES for name in arch.hf_model_types}
_BY_GGUF = {name: arch for arch in ARCHITECTURES for name in arch.gguf_architectures}


def supported_hf() -> str:
    return ", ".join(_BY_HF)


def architecture(name: str) -> Architecture:
    """The class of a `DecoderConfig.architecture` (an HF class name)."""
    if name not in _BY_HF:
        raise ValueError(f"architecture {name!r} is not supported (supported: {supported_hf()}).")
    return _BY_HF[name]


def gguf_architecture(name: Any) -> Architecture:
    if name not in _BY_GGUF:
        raise ValueError(f"GGUF architecture {name!r} is not supported (supported: "
                         f"{', '.join(_BY_GGUF)}; Mistral files say 'llama').")
    return _BY_GGUF[name]


def hf_architecture(hf_config: dict[str, Any]) -> Architecture:
    """The class for a config.json: its `architectures` list, else its `model_type`."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _BY_HF:
            return _BY_HF[name]
    if not names and hf_config.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[hf_config["model_type"]]
    what = (f"architecture {', '.join(map(repr, names))}" if names
            else f"model_type {hf_config.get('model_type')!r}")
    raise ValueError(f"{what} is not supported (supported: {supported_hf()}).")


def config_from_hf(hf_config: dict[str, Any], source: str = "config.json") -> DecoderConfig:
    """A config.json (or a model preset, written the same way) as the config of the class
    that runs it: refusals of what no architecture here builds, rope scaling checked, and a
    sliding window turned into a context limit."""
    arch = hf_architecture(hf_config)
    _refuse_unbuilt(arch, hf_config, source)
    try:
        config = DecoderConfig.from_hf_dict(hf_config, arch.hf_architectures[0])
    except KeyError as e:
        raise ValueError(f"{source}: config.json lacks {e.args[0]!r}.") from None
    arch.configure(config, hf_config)
    # Phi-3 keeps original_max_position_embeddings beside rope_scaling, not in it.
    config.set_rope_scaling(config.rope_scaling, hf_config.get("original_max_position_embeddings"))
    config.limit_to_window(arch.sliding_window(hf_config))
    return config


def _refuse_unbuilt(arch: Architecture, hf: dict[str, Any], source: str) -> None:
    name = arch.hf_architectures[0]
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{source}: {name} with attention_bias or mlp_bias is not supported.")
    # Gemma's configs name it hidden_activation.
    act = hf.get("hidden_act") or hf.get("hidden_activation") or arch.hidden_act
    if act != arch.hidden_act:
        raise ValueError(f"{source}: {name} with activation {act!r} is not supported "
                         f"(only {arch.hidden_act}).")
