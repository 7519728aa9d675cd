"""Qwen3: Qwen2's decoder without the q/k/v biases, with an RMSNorm over each q and k head
before RoPE; its configs set head_dim explicitly (128 where hidden / heads may differ)."""
from __future__ import annotations

from chunkserve.model.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)
    bias_linears = frozenset()
    qk_norm = True
