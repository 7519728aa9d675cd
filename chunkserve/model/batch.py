"""One step's batch as flat arrays: built on the host with numpy, copied to the device once.

The layout is vLLM V1's: the step's tokens are one flat sequence, request i owns tokens
`query_start_loc[i]:query_start_loc[i+1]` of it, has `seq_lens[i]` tokens with KV after the
step, and finds them through row i of `block_table`; `slot_mapping` says where each new
token's K/V goes in the paged cache (block * block_size + offset, -1 for a padding row).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class BatchLayout:
    """Host arrays (int64) of one step; what the attention backends and CUDA graphs read."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S]
    block_table: np.ndarray  # [S, W], rows padded with block 0
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max()) if self.num_seqs else 0

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "input_ids": self.input_ids, "positions": self.positions,
            "slot_mapping": self.slot_mapping, "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens, "block_table": self.block_table,
        }

    def padded(self, num_seqs: int, width: int) -> BatchLayout:
        """This decode-only layout grown to `num_seqs` one-token requests and a block table
        `width` blocks wide, for a CUDA graph captured at that size. A padding request has no
        context (seq_len 0: attention skips it) and slot -1 (nothing is written)."""
        assert self.max_query_len <= 1 and num_seqs >= self.num_seqs
        assert width >= self.block_table.shape[1]
        pad = num_seqs - self.num_seqs
        table = np.zeros((num_seqs, width), dtype=np.int64)
        table[: self.num_seqs, : self.block_table.shape[1]] = self.block_table
        return BatchLayout(
            input_ids=np.concatenate([self.input_ids, np.zeros(pad, np.int64)]),
            positions=np.concatenate([self.positions, np.zeros(pad, np.int64)]),
            slot_mapping=np.concatenate([self.slot_mapping, np.full(pad, -1, np.int64)]),
            query_start_loc=np.arange(num_seqs + 1, dtype=np.int64),
            seq_lens=np.concatenate([self.seq_lens, np.zeros(pad, np.int64)]),
            block_table=table,
            block_size=self.block_size,
        )


@dataclass
class BatchTensors:
    """The same arrays as device tensors, plus the host layout they came from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    layout: BatchLayout
    packed: torch.Tensor | None = None  # the one device buffer the tensors view (CUDA)

    @property
    def max_query_len(self) -> int:
        return self.layout.max_query_len


class PerLayer(tuple):  # type: ignore[type-arg]
    """Attention metadata, one per layer, when layers differ in where their K/V live or how far
    back they attend (KV-cache groups: the layers of a group share one object)."""


def layer_metadata(meta: Any, num_layers: int) -> Sequence[Any]:
    """Each layer's metadata from what the runner passed: one for all, or a PerLayer."""
    return meta if isinstance(meta, PerLayer) else (meta,) * num_layers


class DeviceStager:
    """Copies a step's host arrays to the device in one transfer.

    On CUDA the arrays are packed into one pinned host buffer (reused, grown as needed) and
    sent with a single non-blocking copy; the device tensors are views of one device buffer.
    On the CPU they are wrapped without a copy. The pinned buffer is overwritten only by the
    next step, and every step synchronizes when it reads its sampled tokens, so the previous
    copy has always landed by then.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None

    def to_device(self, layout: BatchLayout) -> BatchTensors:
        if self.device.type == "cpu":
            views = {k: torch.from_numpy(v) for k, v in layout.arrays().items()}
            return BatchTensors(layout=layout, **views)
        host = self._pack(layout)
        return _views(host.to(self.device, non_blocking=True), layout)

    def allocate(self, layout: BatchLayout) -> BatchTensors:
        """Persistent device tensors shaped like `layout` (a CUDA graph's inputs)."""
        total = sum(a.size for a in layout.arrays().values())
        return _views(torch.zeros(total, dtype=torch.int64, device=self.device), layout)

    def copy_into(self, layout: BatchLayout, dest: BatchTensors) -> None:
        """Refills persistent tensors from `allocate` in place: one copy, same shapes."""
        assert dest.packed is not None
        for name, array in layout.arrays().items():
            assert tuple(getattr(dest, name).shape) == array.shape, name
        dest.packed.copy_(self._pack(layout), non_blocking=True)
        dest.layout = layout

    def _pack(self, layout: BatchLayout) -> torch.Tensor:
        arrays = layout.arrays().values()
        total = sum(a.size for a in arrays)
        if self._pinned is None or self._pinned.numel() < total:
            pin = self.device.type == "cuda"  # page-locked: the copy runs asynchronously
            self._pinned = torch.empty(max(2 * total, 4096), dtype=torch.int64, pin_memory=pin)
        host = self._pinned[:total]
        flat = host.numpy()
        offset = 0
        for a in arrays:
            flat[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        return host


def _views(packed: torch.Tensor, layout: BatchLayout) -> BatchTensors:
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for name, a in layout.arrays().items():
        views[name] = packed[offset : offset + a.size].view(a.shape)
        offset += a.size
    return BatchTensors(layout=layout, packed=packed, **views)
