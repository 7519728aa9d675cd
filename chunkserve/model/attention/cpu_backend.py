"""The CPU backend: the torch backend with a step's decodes, and its chunks, each batched into
one C kernel call per layer.

Decodes — one query token each, most of a serving step's requests — go to
`kernels/csrc/paged_decode.c` together, which reads K/V in place through the block table.
Per-request SDPA costs ~0.15 ms of fixed overhead per call, plus a concatenation when a
request's blocks are not consecutive; at 16 decodes that is most of the step. Prefill chunks
go to `kernels/csrc/chunk_attention_bf16.c` (flash attention in AVX512_BF16, also in place) when
the cache is bfloat16 and the CPU has those instructions: 2-3x PyTorch's fused SDPA there; and
float32 chunks over float32 or bfloat16 caches to `kernels/csrc/chunk_attention_avx2.c`, the
same design in AVX2 and FMA (any x86-64-v3 CPU). Elsewhere (float32 queries over fp8 caches, no
AVX2) chunks keep the torch backend's SDPA, one call per chunk (docs/performance.md has the
measurements). The decode kernel and the bf16 chunk kernel also read fp8 caches
(`--kv-cache-dtype fp8`), and the decode kernel and the float32 chunk kernel bfloat16 caches
under float32 queries (`--kv-cache-dtype bfloat16`), widening each value exactly as they read
it.

A sliding window goes to both kernels as one number per call (the KV-cache group's): each
starts a request's keys at the oldest one its queries see, so the blocks before (maybe freed,
pointing at another request's block) are never read, and masks per query. The bf16 chunk kernel
takes head sizes 64, 128 and 256, the float32 one multiples of 8 up to 256; any other sends
chunks to SDPA, windowed the same way (torch_backend.py).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from chunkserve.model.kernels import cpu_library
from chunkserve.model.attention.backend import FP8_DTYPES
from chunkserve.model.attention.torch_backend import TorchMetadata, TorchPagedAttention
from chunkserve.model.batch import BatchTensors

_NARROW_CACHES = (torch.bfloat16, *FP8_DTYPES)  # caches the kernels read under wider queries
_F32_CHUNK_CACHES = (torch.float32, torch.bfloat16)  # what the float32 chunk kernel reads


@dataclass
class CpuMetadata(TorchMetadata):
    # Built once per step for the C calls of every layer: the numpy arrays they read in place
    # (int64, contiguous; kept here so they live as long as the step) and their addresses.
    slots: np.ndarray | None = None  # [T] slot_mapping
    slots_ptr: int = 0
    max_slot: int = -1  # checked against the cache's rows: the copies are not bounds-checked
    decode_arrays: tuple[np.ndarray, ...] = ()  # block table [S_d, W], seq_lens, flat rows
    decode_args: tuple[int, ...] = ()  # table address, W, seq_lens and rows addresses, S_d,
    # window (0: none)
    # The same for the chunks (query runs longer than one token), for the chunk kernels:
    chunk_arrays: tuple[np.ndarray, ...] = ()  # block table [S_c, W], seq_lens, starts, lens
    chunk_args: tuple[int, ...] = ()  # table address, W, the three arrays' addresses, S_c,
    # window


def _kernel_args(layout_arrays: tuple[np.ndarray, ...]) -> tuple[tuple[np.ndarray, ...],
                                                                 tuple[int, ...]]:
    """int64 contiguous copies of (block table, per-request arrays...) that a C call reads in
    place, and its arguments: table address, table width, each array's address, count."""
    arrays = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in layout_arrays)
    table, rest = arrays[0], arrays[1:]
    return arrays, (table.ctypes.data, table.shape[1], *(a.ctypes.data for a in rest),
                    len(rest[0]))


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 isa: str | None = None) -> None:
        """`isa`: the kernels' build (cpu_library.ISAS; default CHUNKSERVE_CPU_ISA's)."""
        super().__init__(num_heads, num_kv_heads, head_dim)
        # Built (or found in the cache) at model load, not in the first step a user waits for.
        self._kernel = cpu_library.load(isa)
        # The chunk kernels, by the queries' dtype (None: those chunks take SDPA).
        self._chunk_kernel = cpu_library.load_chunk_bf16(head_dim, isa)
        self._chunk_kernel_f32 = cpu_library.load_chunk_avx2(head_dim, isa)
        self._write_kv = cpu_library.library(isa).write_kv
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._write_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64]
        self._write_kv.restype = None

    def build_metadata(self, batch: BatchTensors,
                       sliding_window: int | None = None) -> CpuMetadata:
        layout = batch.layout
        decode = layout.query_lens == 1
        window = sliding_window or 0  # the kernels' "none"
        # Spans only for the chunks, which the SDPA loop may attend (float32, no chunk kernel);
        # the decodes go to the kernel, and spans for them cost ~10 us each a step.
        chunks = self._spans(batch, np.flatnonzero(~decode).tolist(), sliding_window)
        slots = np.ascontiguousarray(layout.slot_mapping, dtype=np.int64)
        meta = CpuMetadata(batch.slot_mapping, chunks, slots=slots, slots_ptr=slots.ctypes.data,
                           max_slot=int(slots.max()) if slots.size else -1)
        starts = layout.query_start_loc[:-1]
        if decode.any():
            meta.decode_arrays, args = _kernel_args((
                layout.block_table[decode], layout.seq_lens[decode], starts[decode]))
            meta.decode_args = (*args, window)
        if chunks and (self._chunk_kernel is not None or self._chunk_kernel_f32 is not None):
            meta.chunk_arrays, args = _kernel_args((
                layout.block_table[~decode], layout.seq_lens[~decode], starts[~decode],
                layout.query_lens[~decode]))
            meta.chunk_args = (*args, window)
        return meta

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: CpuMetadata) -> None:  # type: ignore[override]
        self._check_dtypes(k, v, k_cache, v_cache)
        self._write(k, v, k_cache, v_cache, meta)

    def _write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: CpuMetadata) -> None:
        """write_kv once the dtypes are checked."""
        # One memcpy per row: index_copy_ cost ~50 us per call at 64 rows (2 per layer).
        assert meta.slots is not None and k.shape[1:] == k_cache.shape[2:] == v.shape[1:]
        self.check_slots(meta, k_cache.shape[0] * k_cache.shape[1])
        # An fp8 cache takes PyTorch's rounding (to nearest, saturating at the format's largest).
        k, v = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous()
        self._write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                       meta.slots_ptr, len(meta.slots), k[0:1].nbytes)

    @staticmethod
    def check_slots(meta: CpuMetadata, cache_rows: int) -> None:
        """The step's slots are inside a cache of `cache_rows` token rows: the C copies into
        it are not bounds-checked."""
        if meta.max_slot >= cache_rows:
            raise IndexError(f"slot {meta.max_slot} is outside the KV cache ({cache_rows} "
                             f"token rows)")

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata):  # type: ignore[no-untyped-def,override]
        self._check_dtypes(q, k, v, k_cache, v_cache)  # once for every C call below
        self._write(k, v, k_cache, v_cache, meta)
        q = q.contiguous()
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype)
        kv_kind = cpu_library.STORAGE_KINDS[k_cache.dtype]
        chunk_kernel = self._chunk_kernel_for(q.dtype, k_cache.dtype)
        if meta.chunk_args and chunk_kernel is not None:
            failed = chunk_kernel(
                out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_kind,
                *meta.chunk_args, self.num_heads, self.num_kv_heads, self.head_dim,
                k_cache.shape[1], self.scale, torch.get_num_threads())
            if failed:
                raise MemoryError("the CPU chunk attention kernel could not allocate its plan")
        else:
            self._attend(q, k_cache, v_cache, meta.seqs, out)
        if meta.decode_args:
            failed = self._kernel(
                out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                int(q.dtype == torch.bfloat16), kv_kind, *meta.decode_args, self.num_heads,
                self.num_kv_heads, self.head_dim, k_cache.shape[1], self.scale,
                torch.get_num_threads())
            if failed:
                raise MemoryError("the CPU decode kernel could not allocate its score buffers")
        return out

    def _chunk_kernel_for(self, dtype: torch.dtype, kv_dtype: torch.dtype
                          ) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
        """The chunk kernel for these queries and caches: bf16 queries (bf16 or fp8 caches) take
        the AVX512_BF16 one, float32 queries over float32 or bfloat16 caches the AVX2 one (fp8
        caches under float32 queries: SDPA); None where this build lacks it."""
        if dtype is torch.bfloat16:
            return self._chunk_kernel
        return self._chunk_kernel_f32 if kv_dtype in _F32_CHUNK_CACHES else None

    @staticmethod
    def _check_dtypes(*tensors: torch.Tensor) -> None:
        """The C calls take q, K/V and output all float32 or all bfloat16, and the two caches
        (last) that dtype too, both fp8, or (under float32) both bfloat16; contiguous (the caches
        always are). Once per layer: written without generators, it costs well under a
        microsecond."""
        dtype, k_cache, v_cache = tensors[0].dtype, tensors[-2], tensors[-1]
        ok = (dtype is torch.float32 or dtype is torch.bfloat16) and k_cache.dtype is v_cache.dtype
        for t in tensors[:-2]:
            ok = ok and t.dtype is dtype
        ok = ok and (k_cache.dtype is dtype or k_cache.dtype in _NARROW_CACHES)
        if not ok:
            raise TypeError(f"the CPU attention kernels take q, K/V and output all float32 or all "
                            f"bfloat16, and a KV cache of that dtype, bfloat16 or fp8, got "
                            f"{[str(t.dtype) for t in tensors]}")
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
