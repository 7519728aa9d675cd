"""The GPU backend: two Triton kernel launches per layer (write K/V, attend) for a whole step.

A sliding window is a compile-time constant of the attention kernel (one build per window a
model has, none without): each program starts its keys at the oldest one its queries see.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkserve.model.batch import BatchTensors
from chunkserve.model.kernels.triton_attention import reshape_and_cache, unified_attention


@dataclass
class TritonMetadata:
    batch: BatchTensors  # the kernels take its tensors as they are (a CUDA graph's inputs)
    window: int = 0  # sliding window in tokens; 0: full attention


class TritonPagedAttention:
    name = "triton"
    supports_cuda_graphs = True  # reads only the batch's device tensors
    supports_narrow_kv_cache = False  # its kernels read K/V in the model dtype only, for now

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def build_metadata(self, batch: BatchTensors,
                       sliding_window: int | None = None) -> TritonMetadata:
        return TritonMetadata(batch, sliding_window or 0)

    def forward(self, q, k, v, k_cache, v_cache,  # type: ignore[no-untyped-def]
                meta: TritonMetadata):
        batch = meta.batch
        reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        out = torch.empty_like(q)
        unified_attention(
            out, q, k_cache, v_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
            batch.max_query_len, self.scale, meta.window,
        )
        return out.view(q.shape[0], -1)
