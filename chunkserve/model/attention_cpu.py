"""The CPU backend: the torch backend with every decode of a step batched into one kernel call.

Prefill chunks keep PyTorch's fused SDPA (one call per chunk: their cost is the FLOPs, not the
call); decodes — one query token each, most of a serving step's requests — go to the C kernel
(`cpu_kernels/paged_decode.c`, built by `cpu_kernel.py`) together, once per layer, which reads
K/V in place through the block table. Per-request SDPA costs ~0.15 ms of fixed overhead per
call, plus a concatenation when a request's blocks are not consecutive; at 16 decodes that is
most of the step (docs/performance.md).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from chunkserve.model import cpu_kernel
from chunkserve.model.attention_torch import TorchMetadata, TorchPagedAttention
from chunkserve.model.batch import BatchTensors


@dataclass
class CpuMetadata(TorchMetadata):
    slots: np.ndarray | None = None  # [T] int64: slot_mapping for the row copies
    max_slot: int = -1  # checked against the cache's rows: the copies are not bounds-checked
    # The decodes of the step, for the kernel (numpy, int64, contiguous: it reads them in place).
    decode_rows: np.ndarray | None = None  # [S_d] flat token index
    decode_seq_lens: np.ndarray | None = None  # [S_d]
    decode_block_table: np.ndarray | None = None  # [S_d, W]


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        # Built (or found in the cache) at model load, not in the first step a user waits for.
        self._kernel = cpu_kernel.load()
        self._write_rows = cpu_kernel.library().write_rows
        self._write_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64]
        self._write_rows.restype = None

    def build_metadata(self, batch: BatchTensors) -> CpuMetadata:
        layout = batch.layout
        decode = layout.query_lens == 1
        base = super().build_metadata(batch)
        # The SDPA loop keeps only the chunks; the kernel takes the decodes.
        chunks = [seq for seq, d in zip(base.seqs, decode) if not d]
        slots = np.ascontiguousarray(layout.slot_mapping, dtype=np.int64)
        meta = CpuMetadata(base.slot_mapping, chunks, slots=slots,
                           max_slot=int(slots.max()) if slots.size else -1)
        if decode.any():
            meta.decode_rows = np.ascontiguousarray(layout.query_start_loc[:-1][decode],
                                                    dtype=np.int64)
            meta.decode_seq_lens = np.ascontiguousarray(layout.seq_lens[decode], dtype=np.int64)
            meta.decode_block_table = np.ascontiguousarray(layout.block_table[decode],
                                                           dtype=np.int64)
        return meta

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: CpuMetadata) -> None:  # type: ignore[override]
        # One memcpy per row: index_copy_ cost ~50 us per call at 64 rows (2 per layer).
        assert meta.slots is not None and k_cache.is_contiguous() and v_cache.is_contiguous()
        if meta.max_slot >= k_cache.shape[0] * k_cache.shape[1]:
            raise IndexError(f"slot {meta.max_slot} is outside the KV cache "
                             f"({k_cache.shape[0]} blocks of {k_cache.shape[1]})")
        for rows, cache in ((k, k_cache), (v, v_cache)):
            assert rows.dtype == cache.dtype and rows.shape[1:] == cache.shape[2:]
            rows = rows.contiguous()
            self._write_rows(cache.data_ptr(), rows.data_ptr(), meta.slots.ctypes.data,
                             len(meta.slots), rows.shape[1] * rows.shape[2] * rows.element_size())

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata):  # type: ignore[no-untyped-def,override]
        out = super().forward(q, k, v, k_cache, v_cache, meta)  # writes K/V, attends the chunks
        if meta.decode_rows is not None:
            self._decode_all(out, q.contiguous(), k_cache, v_cache, meta)
        return out

    def _decode_all(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: CpuMetadata) -> None:
        dtypes = {q.dtype, out.dtype, k_cache.dtype, v_cache.dtype}
        if dtypes not in ({torch.float32}, {torch.bfloat16}):
            raise TypeError(f"the CPU decode kernel takes q, output and KV cache all float32 or "
                            f"all bfloat16, got {sorted(map(str, dtypes))}")
        assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        table = meta.decode_block_table
        assert table is not None and meta.decode_seq_lens is not None
        failed = self._kernel(
            out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            int(q.dtype == torch.bfloat16), table.ctypes.data, table.shape[1],
            meta.decode_seq_lens.ctypes.data,
            meta.decode_rows.ctypes.data, len(meta.decode_seq_lens), self.num_heads,
            self.num_kv_heads, self.head_dim, k_cache.shape[1], self.scale,
            torch.get_num_threads())
        if failed:
            raise MemoryError("the CPU decode kernel could not allocate its score buffers")
