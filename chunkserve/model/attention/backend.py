"""Paged attention behind a small backend interface.

The step's tokens are one flat sequence (see `batch.BatchLayout`); each request owns a slice of
it — its prefill chunk or its single decode token. A backend first writes the new K/V into the
paged cache by slot mapping, then lets every query token attend over its request's cached
tokens up to its own position (causal aligned to the bottom right: a chunk after a prefix sees
the whole prefix).

Sliding-window layers (Gemma 3's local layers, Mistral's) see only the last W keys: a query at
position p attends keys p-W+1 .. p (attend iff p - k < W, as HF transformers). build_metadata
takes the window of the KV-cache group it is built for (None: full attention). The KV cache
frees a windowed group's blocks that lie wholly before the window of the step's first query,
and the batch's block table then points those entries at block 0 (another request's, or
garbage, NaN even), so with a window a backend masks keys older than W *and never reads* a
block before the first query's window (`first_window_block`): even a masked read is unsafe,
as 0 * NaN = NaN. Backends:
  - `torch` (torch_backend.py): SDPA per request over views of the cache; the CPU path and
    the reference the others are tested against.
  - `cpu` (cpu_backend.py): the torch backend with the step's decodes, and its bfloat16 chunks,
    batched into one C kernel call each per layer.
  - `triton` (triton_backend.py): one kernel launch per layer for the whole step, CUDA
    graph-safe; the GPU path (and the CPU one under TRITON_INTERPRET=1, for tests).
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from chunkserve.model.batch import BatchTensors


# The KV cache dtypes of `--kv-cache-dtype fp8*` (config.FP8_KV_CACHE_DTYPES, vLLM's names:
# fp8 = fp8_e4m3). Values are stored as they are, without a scale: vLLM's k_scale = v_scale =
# 1.0, what it uses when a checkpoint brings no calibrated scales.
FP8_BY_NAME = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = tuple(dict.fromkeys(FP8_BY_NAME.values()))
# Every `--kv-cache-dtype` but auto (vLLM's names). bfloat16 under a float32 model halves the
# bytes a decode reads (the CPU engine on CPUs without AVX512_BF16 runs float32 activations).
KV_DTYPE_BY_NAME = {"bfloat16": torch.bfloat16, **FP8_BY_NAME}


class AttentionBackend(Protocol):
    name: str
    # Whether forward() reads only fixed-shape device tensors (no host values per request), so
    # a decode step can be captured in a CUDA graph and replayed with new inputs.
    supports_cuda_graphs: bool
    # Whether it reads and writes KV caches narrower than the model's dtype (the FP8_DTYPES, and
    # bfloat16 under float32 queries); the model's dtype it always does.
    supports_narrow_kv_cache: bool
    # The softmax scale, head_dim^-0.5 unless the model sets its own (Gemma 3:
    # query_pre_attn_scalar^-0.5); read by every forward(), so a model may set it once built.
    scale: float

    def build_metadata(self, batch: BatchTensors, sliding_window: int | None = None) -> Any:
        """Once per step and KV-cache group: whatever forward() needs beyond the batch tensors
        (`batch` carries that group's block table and slot mapping). `sliding_window`: the
        group's window W in tokens (each query sees its last W positions, itself included),
        or None for full attention, which costs exactly what it did before windows existed.
        With a window, forward() reads no block before `first_window_block`."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:  # [T, heads * head_dim]
        ...


def block_runs(block_table: list[int] | np.ndarray, num_blocks: int) -> list[tuple[int, int]]:
    """Splits the first `num_blocks` ids of a table into runs of consecutive ids."""
    ids = np.asarray(block_table[:num_blocks], dtype=np.int64)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [ids.size]]))
    return list(zip(ids[starts].tolist(), lengths.tolist()))


def first_visible_key(query_pos: int, window: int | None) -> int:
    """The oldest key position a query at `query_pos` attends: query_pos - window + 1, or 0."""
    return 0 if window is None else max(0, query_pos - window + 1)


def first_window_block(start: int, window: int | None, block_size: int) -> int:
    """The first block-table index a request whose step starts at position `start` (its
    cached tokens) may read: the entries before it can be freed blocks (kv_cache.py frees
    exactly those wholly before the window of the step's first query)."""
    return first_visible_key(start, window) // block_size


def causal_mask(start: int, q_len: int, device: torch.device | str = "cpu",
                window: int | None = None, key_start: int = 0) -> torch.Tensor:
    """Query i (position start+i) sees keys 0..start+i: causal aligned to the bottom right.
    With a `window`, only keys start+i-window+1 .. start+i. The mask's columns are the key
    positions key_start .. start+q_len-1 (a caller that skipped the keys before key_start)."""
    q_pos = torch.arange(start, start + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(key_start, start + q_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask
