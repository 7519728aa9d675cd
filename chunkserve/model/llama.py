"""A Llama-family decoder over a flat token batch (RMSNorm, RoPE, GQA, SwiGLU).

Every linear layer runs once over all tokens of the step — prefill chunks and decodes alike —
which is what makes mixing them in one batch pay. Only attention looks at request boundaries.
q/k/v and gate/up are fused into single matrices: fewer, larger GEMMs are faster on a CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from chunkserve.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from chunkserve.model.layers import RotaryEmbedding, rms_norm, silu_and_mul
from chunkserve.model.llama_config import LlamaConfig


class LlamaLayer:
    def __init__(self, cfg: LlamaConfig, w: dict[str, torch.Tensor], i: int, dtype: torch.dtype):
        p = f"model.layers.{i}."
        self.input_norm = w[p + "input_layernorm.weight"].to(dtype)
        self.post_norm = w[p + "post_attention_layernorm.weight"].to(dtype)
        a = p + "self_attn."
        self.qkv = torch.cat([w[a + n + "_proj.weight"] for n in "qkv"]).to(dtype).contiguous()
        self.o = w[a + "o_proj.weight"].to(dtype).contiguous()
        m = p + "mlp."
        self.gate_up = torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]).to(dtype)
        self.down = w[m + "down_proj.weight"].to(dtype).contiguous()
        self.q_size = cfg.num_attention_heads * cfg.head_dim  # type: ignore[operator]
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim  # type: ignore[operator]


class LlamaModel:
    def __init__(
        self,
        cfg: LlamaConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        attention: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype  # of the linear layers' weights and inputs
        # On the CPU attention and the KV cache stay in float32: the fused attention kernel is
        # no faster in bfloat16 and its decode path is ~2x slower, while the linears gain ~4x.
        # On CUDA the KV cache takes the model dtype, as in every GPU engine.
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else dtype
        if self.device.type != "cpu":
            weights = {k: v.to(self.device) for k, v in weights.items()}
        self.embed = weights["model.embed_tokens.weight"].to(dtype)
        head = weights.get("lm_head.weight")
        self.lm_head = self.embed if head is None or cfg.tie_word_embeddings else head.to(dtype)
        self.norm = weights["model.norm.weight"].to(dtype)
        self.layers = [LlamaLayer(cfg, weights, i, dtype) for i in range(cfg.num_hidden_layers)]
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

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final-norm hidden states, [T, hidden]."""
        eps = self.cfg.rms_norm_eps
        # The residual stream stays in float32; only the GEMM inputs use the compute dtype.
        h = self.embed[input_ids].float()
        T = h.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv)
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim).to(self.kv_dtype)
            q, k = self.rope(positions, q, k)  # float32 out
            q, k = q.to(self.kv_dtype), k.to(self.kv_dtype)
            attn = self.attn.forward(q, k, v, k_cache, v_cache, meta)
            h = h + F.linear(attn.to(self.dtype), layer.o).float()
            x = rms_norm(h, layer.post_norm, eps)
            h = h + F.linear(silu_and_mul(F.linear(x, layer.gate_up)), layer.down).float()
        return rms_norm(h, self.norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.dtype), self.lm_head).float()
