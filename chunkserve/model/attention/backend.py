"""Paged attention behind a small backend interface.

The step's tokens are one flat sequence (see `batch.BatchLayout`); each request owns a slice of
it — its prefill chunk or its single decode token. A backend first writes the new K/V into the
paged cache by slot mapping, then lets every query token attend over its request's cached
tokens up to its own position (causal aligned to the bottom right: a chunk after a prefix sees
the whole prefix). Backends:
  - `torch` (torch_backend.py): SDPA per request over views of the cache; the CPU path and
    the reference the others are tested against.
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


class AttentionBackend(Protocol):
    name: str
    # Whether forward() reads only fixed-shape device tensors (no host values per request), so
    # a decode step can be captured in a CUDA graph and replayed with new inputs.
    supports_cuda_graphs: bool
    # Whether it reads and writes KV caches in the FP8_DTYPES (the model's dtype it always does).
    supports_fp8_kv_cache: bool
    # The softmax scale, head_dim^-0.5 unless the model sets its own (Gemma 3:
    # query_pre_attn_scalar^-0.5); read by every forward(), so a model may set it once built.
    scale: float

    def build_metadata(self, batch: BatchTensors) -> Any:
        """Once per step: whatever forward() needs beyond the batch tensors."""
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


def causal_mask(start: int, q_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Query i (position start+i) sees keys 0..start+i: causal aligned to the bottom right."""
    q_pos = torch.arange(start, start + q_len, device=device).unsqueeze(1)
    return torch.arange(start + q_len, device=device).unsqueeze(0) <= q_pos
