"""Scheduler output → the step's flat host arrays (`BatchLayout`), vectorized with numpy.

Per request there is a constant amount of Python (its lengths and its block table row); every
per-token quantity — positions, slot mapping, which rows to sample — is computed as arrays.
"""
from __future__ import annotations

from itertools import chain

import numpy as np

from chunkserve.core.sched_output import ScheduledRequest
from chunkserve.model.batch import BatchLayout


def build_layout(scheduled: list[ScheduledRequest], block_size: int) -> BatchLayout:
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
        table[i, : num_blocks[i]] = s.block_table[: num_blocks[i]]
    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    return BatchLayout(
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, table, block_size
    )


def sample_rows(scheduled: list[ScheduledRequest], layout: BatchLayout) -> np.ndarray:
    """Flat index of the last token of every request that samples this step."""
    samples = np.fromiter((s.samples for s in scheduled), bool, len(scheduled))
    return layout.query_start_loc[1:][samples] - 1
