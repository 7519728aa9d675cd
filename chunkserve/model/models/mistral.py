"""Mistral: Llama's decoder and checkpoint names exactly; only its sliding window differs,
which the config parser turns into a context limit (models/registry.py). Mistral GGUF files
say `llama`, so they load as Llama."""
from __future__ import annotations

from chunkserve.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    hf_architectures = ("MistralForCausalLM",)
    hf_model_types = ("mistral",)
    gguf_architectures = ()
