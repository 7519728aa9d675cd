"""Paged decode attention for the CPU: every decode of a step in one call, compiled by numba.

PyTorch's fused CPU attention costs ~0.2 ms per call for one decode token over a 512-token
context, and the torch backend makes one call per request per layer: at 32 running requests that
is most of a decode step. This kernel takes all of a step's decodes at once and reads K/V in
place through the block table (no gather, no copy): one task per (request, KV head) computes
the scores of the GROUP query heads that share the KV head, a softmax, and the weighted sum of
V. The inner loops run over head_dim on contiguous rows, which LLVM vectorizes (AVX2 FMAs).
"""
from __future__ import annotations

import math

import numba
import numpy as np

# numba's own thread pool: its OpenMP layer would be a second OpenMP runtime beside PyTorch's,
# whose spinning threads then starve each other on a 2-core machine (measured: 30x slower).
numba.config.THREADING_LAYER = "workqueue"


@numba.njit(fastmath=True, boundscheck=False, inline="always")
def _dot(a: np.ndarray, b: np.ndarray) -> float:
    total = np.float32(0.0)
    for d in range(a.shape[0]):
        total += a[d] * b[d]
    return total


@numba.njit(fastmath=True, boundscheck=False, inline="always")
def _axpy(acc: np.ndarray, p: float, x: np.ndarray) -> None:
    for d in range(acc.shape[0]):
        acc[d] += p * x[d]


@numba.njit(parallel=True, fastmath=True, boundscheck=False, cache=True)
def paged_decode_attention(
    out: np.ndarray,  # [T, heads, head_dim]: rows `rows[i]` are written
    q: np.ndarray,  # [T, heads, head_dim]
    k_cache: np.ndarray,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: np.ndarray,
    block_table: np.ndarray,  # [S, W] int64
    seq_lens: np.ndarray,  # [S] int64: context of each decode, its own token included
    rows: np.ndarray,  # [S] int64: each decode's token in the flat batch
    scale: float,
) -> None:
    heads = q.shape[1]
    head_dim = q.shape[2]
    block_size = k_cache.shape[1]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    for task in numba.prange(seq_lens.shape[0] * kv_heads):
        s = task // kv_heads
        h = task % kv_heads
        length = seq_lens[s]
        row = rows[s]
        scores = np.empty((group, length), np.float32)
        for j in range(length):
            key = k_cache[block_table[s, j // block_size], j % block_size, h]
            for g in range(group):
                scores[g, j] = _dot(q[row, h * group + g], key) * scale
        for g in range(group):
            probs = scores[g]
            top = probs.max()
            total = np.float32(0.0)
            for j in range(length):
                e = np.float32(math.exp(probs[j] - top))
                probs[j] = e
                total += e
            inv = np.float32(1.0) / total
            for j in range(length):
                probs[j] *= inv
        acc = np.zeros((group, head_dim), np.float32)
        for j in range(length):
            value = v_cache[block_table[s, j // block_size], j % block_size, h]
            for g in range(group):
                _axpy(acc[g], scores[g, j], value)
        for g in range(group):
            out[row, h * group + g, :] = acc[g]
