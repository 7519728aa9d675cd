"""Scheduler output → the step's flat host arrays (`BatchLayout`), vectorized with numpy.

Per request there is a constant amount of Python (its lengths and its block table row); every
per-token quantity — positions, slot mapping, which rows to sample — is computed as arrays.
"""
from __future__ import annotations

from itertools import chain

import numpy as np

from chunkserve.core.sched_output import ScheduledRequest
from chunkserve.model.batch import BatchLayout


def build_layout(scheduled: list[ScheduledRequest], block_size: int,
                 group: int = 0) -> BatchLayout:
    """The step's arrays, with the block tables and slot mapping of KV-cache group `group`
    (every group's layers see the same tokens; only where their K/V live differs)."""
    num_seqs = len(scheduled)
    q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, num_seqs)
    starts = np.fromiter((s.start for s in scheduled), np.int64, num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    seq_lens = starts + q_lens
    num_tokens = int(query_start_loc[-1])

    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - query_start_loc[seq_of_token] + starts[seq_of_token]
    input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in scheduled), np.int64, num_tokens)

    num_blocks = -(-seq_lens // block_size)
    table = np.zeros((num_seqs, int(num_blocks.max(initial=0))), dtype=np.int64)
    for i, s in enumerate(scheduled):
        table[i, : num_blocks[i]] = s.block_tables[group][: num_blocks[i]]
    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    # New tokens are always inside their window, never in a hole (NULL_BLOCK, -1) of a
    # sliding-window table; the holes become block 0, like padding: attention never reads them.
    assert not num_tokens or slot_mapping.min() >= 0, "a new token's block was freed"
    np.maximum(table, 0, out=table)
    return BatchLayout(
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, table, block_size
    )


def sample_rows(scheduled: list[ScheduledRequest], layout: BatchLayout) -> np.ndarray:
    """Flat index of the last token of every request that samples this step."""
    samples = np.fromiter((s.samples for s in scheduled), bool, len(scheduled))
    return layout.query_start_loc[1:][samples] - 1
