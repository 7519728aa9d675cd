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
