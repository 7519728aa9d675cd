"""The GPU backend: two Triton kernel launches per layer (write K/V, attend) for a whole step."""
from __future__ import annotations

import torch

from chunkserve.model.batch import BatchTensors
from chunkserve.model.kernels.triton_attention import reshape_and_cache, unified_attention


class TritonPagedAttention:
    name = "triton"
    supports_cuda_graphs = True  # reads only the batch's device tensors
    supports_fp8_kv_cache = False  # its kernels read K/V in the model dtype only, for now

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def build_metadata(self, batch: BatchTensors) -> BatchTensors:
        return batch  # the kernels take the batch's tensors as they are

    def forward(self, q, k, v, k_cache, v_cache, meta: BatchTensors):  # type: ignore[no-untyped-def]
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        unified_attention(
            out, q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, self.scale,
        )
        return out.view(q.shape[0], -1)
