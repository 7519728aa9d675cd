"""The Llama decoder over a flat token batch (RMSNorm, RoPE, GQA, SwiGLU), and what an
architecture built on it may declare differently.

Every linear layer runs once over all tokens of the step — prefill chunks and decodes alike —
which is what makes mixing them in one batch pay. Only attention looks at request boundaries.
q/k/v and gate/up are fused into single matrices: fewer, larger GEMMs are faster on a CPU.

The other architectures (mistral.py, qwen2.py, qwen3.py, phi3.py, gemma3.py) are this decoder
with some of the class attributes under "What an architecture declares" overridden (Gemma 3,
whose layer is ordered differently, also its forward). The loaders, the dummy
weights and the checkpoint checks read those declarations from the class, so nothing downstream
asks which architecture it has.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, ClassVar

import torch

from chunkserve.model.attention.backend import AttentionBackend
from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.batch import layer_metadata
from chunkserve.model.layers.layer_ops import LayerOps, TorchLayerOps
from chunkserve.model.layers.linear import Linear, make_linear
from chunkserve.model.layers.linear_int4 import Int4Linear
from chunkserve.model.layers.rotary import RotaryEmbedding
from chunkserve.model.models.config import DecoderConfig

Weights = MutableMapping[str, torch.Tensor]  # a dict, or loaders/lazy.py's LazyWeights


def _take(w: Weights, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Popped, and converted straight to its final device and dtype: the loader's copy is
    # dropped tensor by tensor, so building the model never holds two copies of it (an 8B
    # model is 32 GB in float32).
    return w.pop(name).to(device=device, dtype=dtype)


def _take_norm(arch: type[LlamaForCausalLM], w: Weights, name: str,
               device: torch.device) -> torch.Tensor:
    """An RMSNorm weight in float32 (RMSNorm runs in float32 whatever the compute dtype), with
    the architecture's offset folded in at load: Gemma's x·(1+w) becomes x·w' for every norm op
    (PyTorch's and the C ones), so no path has to know, and Llama's weights are untouched."""
    weight = _take(w, name, torch.float32, device)
    return weight + arch.norm_weight_offset if arch.norm_weight_offset else weight


# Quantize, then shard: a tensor-parallel rank's row-parallel weight (o_proj, down_proj: some
# of each output channel's inputs) comes with "<linear>.row_absmax", its full rows' largest |w|
# (model/parallel.py). A scale per output channel taken over the rank's inputs alone would give
# each rank other int8 levels than one process's; with it they are one process's, sliced.
ROW_ABSMAX = ".row_absmax"


class LlamaLayer:
    def __init__(self, arch: type[LlamaForCausalLM], w: Weights, i: int, dtype: torch.dtype,
                 device: torch.device, quantization: str | None = None) -> None:
        p = f"model.layers.{i}."

        def linear(name: str) -> Linear:
            # int8 and int4 are quantized from the float32 weights, not a bf16 rounding of them.
            source = torch.float32 if quantization else dtype
            parts = arch.checkpoint_parts(name)
            weight = torch.cat([_take(w, f"{p}{n}.weight", source, device) for n in parts])
            bias = None
            if any(f"{p}{n}.bias" in w for n in parts):
                bias = torch.cat([_take(w, f"{p}{n}.bias", torch.float32, device) for n in parts])
            # A tensor-parallel rank's row-parallel shard comes with its full rows' largest
            # |w| (model/parallel.py, ROW_ABSMAX), for one process's per-channel int8 scales.
            absmax = [f"{p}{n}{ROW_ABSMAX}" for n in parts]
            row_absmax = (torch.cat([_take(w, a, torch.float32, device) for a in absmax])
                          if absmax[0] in w else None)
            return make_linear(weight, quantization, dtype, bias, row_absmax)

        self.input_norm = _take_norm(arch, w, p + "input_layernorm.weight", device)
        self.post_norm = _take_norm(arch, w, p + "post_attention_layernorm.weight", device)
        # The norms an architecture adds (Gemma 3: around the MLP), by checkpoint name.
        self.extra_norms = {name: _take_norm(arch, w, f"{p}{name}.weight", device)
                            for name in arch.extra_layer_norms}
        self.qkv = linear("self_attn.qkv_proj")
        self.o = linear("self_attn.o_proj")
        self.gate_up = linear("mlp.gate_up_proj")
        self.down = linear("mlp.down_proj")
        # Per-head RMSNorm weights of q and k (Qwen3), applied before RoPE.
        self.qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None
        if arch.qk_norm:
            self.qk_norm = (_take_norm(arch, w, p + "self_attn.q_norm.weight", device),
                            _take_norm(arch, w, p + "self_attn.k_norm.weight", device))


class LlamaForCausalLM:
    # --- What an architecture declares: a variant overrides these, and only these. ---
    # Its names: config.json `architectures` (and `model_type`), GGUF `general.architecture`.
    hf_architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    hf_model_types: ClassVar[tuple[str, ...]] = ("llama",)
    gguf_architectures: ClassVar[tuple[str, ...]] = ("llama",)
    # The fused linears the decoder runs, and the checkpoint linears stacked into each, in
    # order (vLLM's packed_modules_mapping).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    # Fused linears that checkpoints store already fused (Phi-3's qkv_proj, gate_up_proj).
    fused_on_disk: ClassVar[frozenset[str]] = frozenset()
    # Checkpoint linears that carry a bias (Qwen2: q, k and v).
    bias_linears: ClassVar[frozenset[str]] = frozenset()
    # An RMSNorm over each q and k head before RoPE (Qwen3: self_attn.q_norm / k_norm).
    qk_norm: ClassVar[bool] = False
    # llama.cpp's converter reorders q/k rows to pairs for GGUF "llama" files only: its RoPE
    # rotates adjacent pairs there, halves (as HF does) for qwen2, qwen3 and phi3.
    gguf_qk_interleaved: ClassVar[bool] = True
    # GGUF tensor names (blk.N.<name>) that mean another HF tensor in this architecture than
    # loaders/gguf.py's common table says (Phi-3 stores gate and up fused under ffn_up).
    gguf_renames: ClassVar[dict[str, str]] = {}
    # RMSNorm scales by (offset + w): Gemma stores its norm weights around 0 and applies 1 + w.
    norm_weight_offset: ClassVar[float] = 0.0
    # Per-layer RMSNorms beyond input_layernorm and post_attention_layernorm (checkpoint names
    # within a layer; Gemma 3: pre_ and post_feedforward_layernorm).
    extra_layer_norms: ClassVar[tuple[str, ...]] = ()
    # The MLP's activation, as config.json names it (hidden_act, or Gemma's hidden_activation).
    hidden_act: ClassVar[str] = "silu"

    @classmethod
    def configure(cls, config: DecoderConfig, hf_config: dict[str, Any]) -> None:
        """Reads what only this architecture has from a config.json into `config` (after the
        common fields, before rope scaling is checked), refusing what it does not build."""

    @classmethod
    def sliding_window(cls, hf_config: dict[str, Any]) -> int | None:
        """The attention window a config.json sets, or None (full attention)."""
        return hf_config.get("sliding_window")

    @classmethod
    def checkpoint_parts(cls, fused: str) -> tuple[str, ...]:
        """The checkpoint linears (HF names within a layer) that make up linear `fused`."""
        if fused in cls.fused_on_disk:
            return (fused,)
        return cls.packed_modules_mapping.get(fused, (fused,))

    # --- The decoder. ---
    def __init__(
        self,
        cfg: DecoderConfig,
        weights: Weights,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        attention: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        quantization: str | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        """Consumes `weights` (HF names, as this architecture's checkpoints have them): each
        tensor is removed from the dict as the model takes it.
        With `quantization="int8"` every linear layer and the LM head are int8 (layers/linear.py),
        with "int4" the layers are int4 (layers/linear_int4.py), with "auto" each linear is int4
        where its weights already are 4-bit (a Q4 GGUF), else int8; `dtype` is then the
        activations' dtype and that of the dense copy prefill rows use.
        `ops`: norms, RoPE and SiLU (layers/layer_ops.py; default PyTorch's)."""
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
        self._build_weights(weights, quantization)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim: int = cfg.head_dim  # type: ignore[assignment]
        self.rope = RotaryEmbedding(
            self.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            self.device,
            rotary_dim=cfg.rotary_dim,
        )
        self.attn = attention or TorchPagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.ops = ops or TorchLayerOps()

    def _build_weights(self, weights: Weights, quantization: str | None) -> None:
        dtype, dev = self.dtype, self.device
        self.embed = _take(weights, "model.embed_tokens.weight", dtype, dev)
        head = weights.pop("lm_head.weight", None)
        tied = head is None or self.cfg.tie_word_embeddings
        head = self.embed if tied else head.to(device=dev, dtype=dtype)  # type: ignore[union-attr]
        # The head (often the embedding, kept at 8 bits by GGUF files) is int4 only where it
        # already is 4-bit: logits are where a coarser weight shows most.
        head_quant = "auto" if quantization == "int4" else quantization
        self.lm_head = make_linear(head, head_quant, dtype)
        self.norm = _take_norm(type(self), weights, "model.norm.weight", dev)
        self.layers = [
            LlamaLayer(type(self), weights, i, dtype, dev, quantization)
            for i in range(self.cfg.num_hidden_layers)
        ]
        if quantization == "auto":  # what it became, for whoever records the format
            self.quantization = "int4" if isinstance(self.layers[0].qkv, Int4Linear) else "int8"

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
        h = self.embed_tokens(input_ids).float()
        mlp_out = None
        metas = layer_metadata(meta, len(self.layers))
        for layer, (k_cache, v_cache), layer_meta in zip(self.layers, kv_caches, metas):
            x = ops.add_rms_norm(h, mlp_out, layer.input_norm, eps, self.dtype)
            q, k, v = ops.rope_split_qkv(layer.qkv(x), cos, sin, self.num_heads,
                                         self.num_kv_heads, self.head_dim, layer.qk_norm, eps)
            attn = self.attn.forward(q, k, v, k_cache, v_cache, layer_meta)
            x = ops.add_rms_norm(h, layer.o(attn), layer.post_norm, eps, self.dtype)
            mlp_out = layer.down(ops.silu_and_mul(layer.gate_up(x)))
        return ops.add_rms_norm(h, mlp_out, self.norm, eps, self.dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' embedding rows (model/tp_layers.py replaces it on a tensor-parallel rank)."""
        return self.embed[input_ids]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def layer_windows(self) -> list[int | None]:
        # Full attention everywhere: a model with a window is capped to it (limit_to_window).
        return [None] * len(self.layers)
