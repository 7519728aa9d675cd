"""A Llama-family decoder over a flat token batch (RMSNorm, RoPE, GQA, SwiGLU).

Every linear layer runs once over all tokens of the step — prefill chunks and decodes alike —
which is what makes mixing them in one batch pay. Only attention looks at request boundaries.
q/k/v and gate/up are fused into single matrices: fewer, larger GEMMs are faster on a CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from chunkserve.model.attention.backend import AttentionBackend
from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.layers.layer_ops import LayerOps, TorchLayerOps
from chunkserve.model.layers.rotary import RotaryEmbedding
from chunkserve.model.layers.linear import Linear, make_linear
from chunkserve.model.layers.linear_int4 import Int4Linear
from chunkserve.model.models.config import LlamaConfig


def _take(w: dict[str, torch.Tensor], name: str, dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
    # Popped, and converted straight to its final device and dtype: the loader's copy is
    # dropped tensor by tensor, so building the model never holds two copies of it (an 8B
    # model is 32 GB in float32).
    return w.pop(name).to(device=device, dtype=dtype)


class LlamaLayer:
    def __init__(self, cfg: LlamaConfig, w: dict[str, torch.Tensor], i: int, dtype: torch.dtype,
                 device: torch.device, quantization: str | None = None):
        p = f"model.layers.{i}."

        def linear(*names: str) -> Linear:
            # int8 and int4 are quantized from the float32 weights, not a bf16 rounding of them.
            source = torch.float32 if quantization else dtype
            weight = torch.cat([_take(w, p + n, source, device) for n in names])
            return make_linear(weight, quantization, dtype)

        # Norm weights stay float32 whatever the compute dtype: RMSNorm runs in float32.
        self.input_norm = _take(w, p + "input_layernorm.weight", torch.float32, device)
        self.post_norm = _take(w, p + "post_attention_layernorm.weight", torch.float32, device)
        self.qkv = linear("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight")
        self.o = linear("self_attn.o_proj.weight")
        self.gate_up = linear("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down = linear("mlp.down_proj.weight")


class LlamaModel:
    def __init__(
        self,
        cfg: LlamaConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        attention: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        """Consumes `weights`: each tensor is removed from the dict as the model takes it.
        With `quantization="int8"` every linear layer and the LM head are int8 (linear.py),
        with "int4" the layers are int4 (linear_int4.py), with "auto" each linear is int4 where
        its weights already are 4-bit (a Q4 GGUF), else int8; `dtype` is then the activations'
        dtype and that of the dense copy prefill rows use.
        `ops`: norms, RoPE and SiLU (layer_ops.py; default PyTorch's)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype  # of the linear layers' weights and inputs
        self.quantization = quantization
        # The KV cache and attention take the model dtype, as in every GPU engine. On a CPU
        # with AMX, SDPA over bfloat16 prefill chunks is 2.3-2.8x faster than over float32,
        # and decode attention (the `cpu` backend's kernel) is bound by reading K/V, so half
        # the bytes. (PyTorch's own bf16 SDPA *decode* path is slow: the `torch` backend is
        # the reference there, not the fast path.)
        self.kv_dtype = dtype
        dev = self.device
        self.embed = _take(weights, "model.embed_tokens.weight", dtype, dev)
        head = weights.pop("lm_head.weight", None)
        tied = head is None or cfg.tie_word_embeddings
        head = self.embed if tied else head.to(device=dev, dtype=dtype)  # type: ignore[union-attr]
        # The head (often the embedding, kept at 8 bits by GGUF files) is int4 only where it
        # already is 4-bit: logits are where a coarser weight shows most.
        head_quant = "auto" if quantization == "int4" else quantization
        self.lm_head = make_linear(head, head_quant, dtype)
        self.norm = _take(weights, "model.norm.weight", torch.float32, dev)
        self.layers = [
            LlamaLayer(cfg, weights, i, dtype, dev, quantization)
            for i in range(cfg.num_hidden_layers)
        ]
        if quantization == "auto":  # what it became, for whoever records the format
            self.quantization = "int4" if isinstance(self.layers[0].qkv, Int4Linear) else "int8"
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim: int = cfg.head_dim  # type: ignore[assignment]
        self.rope = RotaryEmbedding(
            self.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            self.device,
        )
        self.attn = attention or TorchPagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.ops = ops or TorchLayerOps()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,  # from self.attn.build_metadata
    ) -> torch.Tensor:
        """Returns the final-norm hidden states, [T, hidden]."""
        eps, ops = self.cfg.rms_norm_eps, self.ops
        cos, sin = self.rope.cos_sin(positions)
        # The residual stream stays in float32; only the GEMM inputs use the compute dtype.
        # Each residual add is done by the norm that follows it (one pass instead of two).
        h = self.embed[input_ids].float()
        mlp_out = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = ops.add_rms_norm(h, mlp_out, layer.input_norm, eps, self.dtype)
            q, k, v = ops.rope_split_qkv(layer.qkv(x), cos, sin, self.num_heads,
                                         self.num_kv_heads, self.head_dim)
            attn = self.attn.forward(q, k, v, k_cache, v_cache, meta)
            x = ops.add_rms_norm(h, layer.o(attn), layer.post_norm, eps, self.dtype)
            mlp_out = layer.down(ops.silu_and_mul(layer.gate_up(x)))
        return ops.add_rms_norm(h, mlp_out, self.norm, eps, self.dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
