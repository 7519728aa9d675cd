"""Qwen2 and Qwen2.5: Llama's decoder with a bias on the q, k and v projections."""
from __future__ import annotations

from typing import Any

from chunkserve.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    hf_architectures = ("Qwen2ForCausalLM",)
    hf_model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)
    bias_linears = frozenset({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"})
    gguf_qk_interleaved = False

    @classmethod
    def sliding_window(cls, hf_config: dict[str, Any]) -> int | None:
        # Qwen configs carry a window that is off unless use_sliding_window says otherwise.
        return hf_config.get("sliding_window") if hf_config.get("use_sliding_window") else None
