"""Step layouts shared by the attention backend tests: decodes, chunks, mixes, any block table."""
from __future__ import annotations

import numpy as np
import torch

from chunkserve.model.batch import BatchLayout

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS = 96

# (tokens cached before the step, new tokens this step) per request
DECODES = [(37, 1), (5, 1), (0, 1), (64, 1)]
FIRST_CHUNKS = [(0, 20), (0, 7), (0, 1)]
LATER_CHUNKS = [(40, 24), (16, 16), (3, 9)]
MIXED = [(0, 13), (70, 1), (33, 40), (5, 1), (16, 9)]

# The hand-vectorized kernels' cases (test_cpu_attention.py, test_cpu_attention_avx2.py).
# Decodes over runs of tokens cut by blocks smaller, equal and larger than a run, and a chunk:
KERNEL_DECODES = [(0, 1), (15, 1), (16, 1), (17, 1), (300, 1), (255, 1), (40, 30)]
# Query-head groups that fill the bf16 decode path's register passes (4 heads of 64, 2 of 128)
# exactly, partly and more than once:
DECODE_HEADS = [(9, 3, 64), (4, 4, 64), (16, 2, 64), (10, 2, 64), (8, 2, 128), (6, 2, 128),
                (2, 2, 128)]
# Chunks of tiles exactly, less than one, and a part tile over (16-row tiles in the bf16
# kernel, 8-row ones in the AVX2 one); prefixes on and off tile and block edges:
CHUNKS = [(0, 2), (0, 16), (0, 17), (15, 33), (16, 16), (17, 5), (100, 40), (3, 1)]
CHUNK_HEADS = [(9, 3, 64), (4, 4, 64), (16, 2, 64), (8, 2, 128), (2, 2, 128)]


def fits_pool(spec: list[tuple[int, int]], block_size: int) -> bool:
    """Whether a (computed, new) spec's blocks fit the NUM_BLOCKS pool: random batches of up to
    5 requests of 190 tokens at 8-token blocks can need 120 blocks, and a strategy `assume`s
    this rather than fail in make_layout."""
    return sum(-(-(p + n) // block_size) for p, n in spec) <= NUM_BLOCKS


def make_layout(spec: list[tuple[int, int]], block_size: int, contiguous: bool,
                seed: int = 0) -> BatchLayout:
    rng = np.random.default_rng(seed)
    ids = np.arange(NUM_BLOCKS) if contiguous else rng.permutation(NUM_BLOCKS)
    q_lens = np.array([n for _, n in spec], dtype=np.int64)
    seq_lens = np.array([p + n for p, n in spec], dtype=np.int64)
    nblocks = -(-seq_lens // block_size)
    assert nblocks.sum() <= NUM_BLOCKS
    table = np.zeros((len(spec), int(nblocks.max())), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(nblocks)])
    for i in range(len(spec)):
        table[i, : nblocks[i]] = ids[offsets[i] : offsets[i + 1]]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    seq_of_token = np.repeat(np.arange(len(spec)), q_lens)
    positions = np.arange(qsl[-1]) - qsl[seq_of_token] + (seq_lens - q_lens)[seq_of_token]
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    return BatchLayout(np.zeros(qsl[-1], np.int64), positions, slots, qsl, seq_lens, table,
                       block_size)


def run_step(backend, layout: BatchLayout, heads: int, kv_heads: int, head_dim: int,  # type: ignore[no-untyped-def]
             seed: int = 1, dtype: torch.dtype = torch.float32,
             values_in: torch.dtype | None = None):
    """(out, k_cache, v_cache) of one step through `backend` on random q/k/v and caches; the
    same arguments give the same data, so two backends' results compare directly. The data is
    stored as `dtype`; `values_in` first rounds it to that type's values (a float32 reference
    on exactly the values a bfloat16 run sees)."""
    from chunkserve.model.batch import DeviceStager

    gen = torch.Generator().manual_seed(seed)
    T = layout.num_tokens
    shape = (NUM_BLOCKS, layout.block_size, kv_heads, head_dim)
    q, k, v, kc, vc = (
        torch.randn(s, generator=gen).to(values_in or dtype).to(dtype).to(DEVICE)
        for s in ((T, heads, head_dim), (T, kv_heads, head_dim), (T, kv_heads, head_dim),
                  shape, shape))
    batch = DeviceStager(DEVICE).to_device(layout)
    with torch.inference_mode():
        out = backend.forward(q, k, v, kc, vc, backend.build_metadata(batch))
    return out, kc, vc
