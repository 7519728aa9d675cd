"""The CPU backend: the torch backend with every decode of a step batched into one kernel call.

Prefill chunks keep PyTorch's fused SDPA (one call per chunk: their cost is the FLOPs, not the
call); decodes — one query token each, most of a serving step's requests — go to
`cpu_decode_kernel.paged_decode_attention` together, once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunkserve.model.attention_torch import TorchMetadata, TorchPagedAttention
from chunkserve.model.batch import BatchTensors
from chunkserve.model.cpu_decode_kernel import paged_decode_attention


@dataclass
class CpuMetadata(TorchMetadata):
    # The decodes of the step, for the batched kernel (numpy: the kernel reads them in place).
    decode_rows: np.ndarray | None = None  # [S_d] flat token index
    decode_seq_lens: np.ndarray | None = None  # [S_d]
    decode_block_table: np.ndarray | None = None  # [S_d, W]


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        _warm_up(num_heads, num_kv_heads, head_dim)

    def build_metadata(self, batch: BatchTensors) -> CpuMetadata:
        layout = batch.layout
        decode = layout.query_lens == 1
        base = super().build_metadata(batch)
        # The SDPA loop keeps only the chunks; the kernel takes the decodes.
        chunks = [seq for seq, d in zip(base.seqs, decode) if not d]
        meta = CpuMetadata(base.slot_mapping, chunks)
        if decode.any():
            meta.decode_rows = np.ascontiguousarray(layout.query_start_loc[:-1][decode])
            meta.decode_seq_lens = np.ascontiguousarray(layout.seq_lens[decode])
            meta.decode_block_table = np.ascontiguousarray(layout.block_table[decode])
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata):  # type: ignore[no-untyped-def,override]
        out = super().forward(q, k, v, k_cache, v_cache, meta)  # writes K/V, attends the chunks
        if meta.decode_rows is not None:
            paged_decode_attention(
                out.view(q.shape).numpy(), q.numpy(), k_cache.numpy(), v_cache.numpy(),
                meta.decode_block_table, meta.decode_seq_lens, meta.decode_rows,
                np.float32(self.scale),
            )
        return out


def _warm_up(heads: int, kv_heads: int, head_dim: int) -> None:
    """Compiles the kernel (or loads it from numba's on-disk cache) at model load, with the
    argument types of a real step, instead of in the first decode step a user waits for."""
    q = np.zeros((1, heads, head_dim), np.float32)
    cache = np.zeros((1, 16, kv_heads, head_dim), np.float32)
    one = np.ones(1, np.int64)
    paged_decode_attention(np.empty_like(q), q, cache, cache, np.zeros((1, 1), np.int64), one,
                           one - 1, np.float32(1.0))
