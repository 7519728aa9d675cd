"""Gemma 3 (text): Llama's decoder with
- the embedding scaled by sqrt(hidden_size), in the weight dtype;
- RMSNorm as x·(1+w) in float32: the +1 is folded into every norm weight at load
  (`norm_weight_offset`), so the norm ops, PyTorch's and the C ones, are Llama's;
- Qwen3's per-head q/k RMSNorm before RoPE;
- four norms per layer: input → attention → post_attention_layernorm → +residual →
  pre_feedforward_layernorm → GeGLU (gelu-tanh) → post_feedforward_layernorm → +residual;
- the softmax scale query_pre_attn_scalar^-0.5;
- sliding-window ("local") layers with RoPE base rope_local_base_freq, full ("global") layers
  with rope_theta and rope_scaling, the pattern from `layer_types` (or sliding_window_pattern);
- optional final logit softcapping.

The sliding layers keep the whole context: their KV is a sliding-window KV-cache group
(core/kv_groups.py: blocks that leave the window are freed) and the attention backends mask
keys older than the window (`layer_windows`). From GGUF, llama.cpp's names for the four norms
are renamed, and what it hard-codes (the layer pattern, the local RoPE base) is filled in by
loaders/gguf_config.py.
"""
from __future__ import annotations

from typing import Any

import torch

from chunkserve.layer_types import FULL, SLIDING, layer_types
from chunkserve.model.attention.backend import AttentionBackend
from chunkserve.model.batch import layer_metadata
from chunkserve.model.layers.layer_ops import LayerOps, gelu_tanh_and_mul
from chunkserve.model.layers.rotary import RotaryEmbedding
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.llama import LlamaForCausalLM, Weights

# transformers' defaults for fields a Gemma 3 config.json may leave out.
DEFAULT_SCALAR = 256.0
DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0


def _rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global rope_scaling, local theta), from transformers >= 5's per-layer-type
    `rope_parameters` or the older rope_theta / rope_scaling / rope_local_base_freq fields.
    As in transformers, rope_scaling applies to the global layers only."""
    params = hf.get("rope_parameters") or {}
    full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    theta = full.get("rope_theta", hf.get("rope_theta", DEFAULT_GLOBAL_THETA))
    scaling = hf.get("rope_scaling")
    if full.get("rope_type", "default") != "default":
        scaling = dict(full)
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma3ForCausalLM: rope scaling on the sliding-window layers "
                         f"({local['rope_type']!r}) is not supported.")
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))
    return float(theta), scaling, float(local_theta)


class Gemma3ForCausalLM(LlamaForCausalLM):
    hf_architectures = ("Gemma3ForCausalLM",)
    hf_model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)
    # llama.cpp calls the norm before the MLP ffn_norm, Llama's post-attention norm's name.
    gguf_renames = {"post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
    qk_norm = True
    gguf_qk_interleaved = False
    norm_weight_offset = 1.0
    extra_layer_norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    hidden_act = "gelu_pytorch_tanh"

    @classmethod
    def configure(cls, config: DecoderConfig, hf_config: dict[str, Any]) -> None:
        # Refused, not ignored: each would change every output.
        if hf_config.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma3ForCausalLM with attn_logit_softcapping is not supported "
                             "(Gemma 3 checkpoints set it to null).")
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError("Gemma3ForCausalLM with use_bidirectional_attention is not "
                             "supported (a causal LM is served).")
        config.layer_types = layer_types(hf_config)
        config.rope_theta, config.rope_scaling, config.rope_local_base_freq = \
            _rope_settings(hf_config)
        config.query_pre_attn_scalar = float(hf_config.get("query_pre_attn_scalar",
                                                           DEFAULT_SCALAR))
        config.final_logit_softcapping = hf_config.get("final_logit_softcapping")

    @classmethod
    def sliding_window(cls, hf_config: dict[str, Any]) -> int | None:
        # Only a model with a sliding-window layer is limited by its window.
        return hf_config.get("sliding_window") if SLIDING in layer_types(hf_config) else None

    def __init__(self, cfg: DecoderConfig, weights: Weights, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, attention: AttentionBackend | None = None,
                 device: torch.device | str = "cpu", quantization: str | None = None,
                 ops: LayerOps | None = None) -> None:
        super().__init__(cfg, weights, dtype, max_positions, attention, device, quantization, ops)
        assert cfg.layer_types is not None and cfg.query_pre_attn_scalar is not None
        # Every backend reads its scale at each forward, so setting it here is enough.
        self.attn.scale = cfg.query_pre_attn_scalar ** -0.5
        # self.rope (Llama's: rope_theta and rope_scaling) serves the global layers.
        self.rope_local = RotaryEmbedding(
            self.head_dim, self.rope.max_positions, cfg.rope_local_base_freq or cfg.rope_theta,
            None, self.device, rotary_dim=cfg.rotary_dim)
        self.is_sliding = [t == SLIDING for t in cfg.layer_types]
        # transformers multiplies in the weight dtype: sqrt(640) rounds to 25.25 in bfloat16.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(self.device, self.embed.dtype)

    def _post_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of a sublayer's output before it joins the residual stream: float32 out, as
        the stream is (no in-place add: delta is None)."""
        return self.ops.add_rms_norm(x.float().contiguous(), None, weight, self.cfg.rms_norm_eps,
                                     torch.float32)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        """Returns the final-norm hidden states, [T, hidden]."""
        eps, ops = self.cfg.rms_norm_eps, self.ops
        global_rope, local_rope = self.rope.cos_sin(positions), self.rope_local.cos_sin(positions)
        # As in Llama: a float32 residual stream, each add done by the norm that follows it.
        h = (self.embed_tokens(input_ids) * self.embed_scale).float()
        delta = None
        metas = layer_metadata(meta, len(self.layers))
        for layer, sliding, (k_cache, v_cache), layer_meta in zip(
                self.layers, self.is_sliding, kv_caches, metas):
            x = ops.add_rms_norm(h, delta, layer.input_norm, eps, self.dtype)
            cos, sin = local_rope if sliding else global_rope
            q, k, v = ops.rope_split_qkv(layer.qkv(x), cos, sin, self.num_heads,
                                         self.num_kv_heads, self.head_dim, layer.qk_norm, eps)
            attn = self.attn.forward(q, k, v, k_cache, v_cache, layer_meta)
            delta = self._post_norm(layer.o(attn), layer.post_norm)
            x = ops.add_rms_norm(h, delta, layer.extra_norms["pre_feedforward_layernorm"], eps,
                                 self.dtype)
            mlp_out = layer.down(gelu_tanh_and_mul(layer.gate_up(x)))
            delta = self._post_norm(mlp_out, layer.extra_norms["post_feedforward_layernorm"])
        return ops.add_rms_norm(h, delta, self.norm, eps, self.dtype)

    def layer_windows(self) -> list[int | None]:
        window = self.cfg.sliding_window
        if window is None or window >= self.rope.max_positions:
            return [None] * len(self.layers)  # the window never slides within the context
        return [window if sliding else None for sliding in self.is_sliding]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
