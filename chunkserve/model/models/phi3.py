"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama's decoder with q/k/v and gate/up stored fused on
disk, longrope scaling for long contexts, and partial rotary embeddings in Phi-4-mini."""
from __future__ import annotations

from chunkserve.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    hf_architectures = ("Phi3ForCausalLM",)
    hf_model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    fused_on_disk = frozenset({"self_attn.qkv_proj", "mlp.gate_up_proj"})
    gguf_qk_interleaved = False
    # llama.cpp names Phi-3's fused gate/up tensor ffn_up.
    gguf_renames = {"ffn_up": "mlp.gate_up_proj"}
