"""What the engine needs of a model, whatever its architecture (engine/model_runner.py and
engine/cuda_graph.py type against this, not against a class)."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from chunkserve.model.attention.backend import AttentionBackend
from chunkserve.model.layers.rotary import RotaryEmbedding


class CausalLM(Protocol):
    device: torch.device
    dtype: torch.dtype  # of the linear layers' inputs
    kv_dtype: torch.dtype  # of the KV cache, unless --kv-cache-dtype says otherwise
    attn: AttentionBackend
    layers: list[Any]  # one KV cache each
    num_kv_heads: int
    head_dim: int
    rope: RotaryEmbedding  # its max_positions bounds the context

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        """The final-norm hidden states of a flat step, [T, hidden]. `meta`: the attention
        backend's metadata for every layer, or a `PerLayer` of one per layer."""
        ...

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding attention window (None: full attention): its KV-cache group."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...
