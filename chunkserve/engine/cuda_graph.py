"""Decode-only steps replayed as CUDA graphs, captured once at padded batch sizes.

A decode step launches a few hundred small kernels whose CPU-side launch cost is larger than
their GPU time at small batches. Capturing the model's forward once per batch size and
replaying it turns all of them into one launch (vLLM V1 does the same; its sizes are
1, 2, 4, 8, then multiples of 8). A step of B decodes replays the smallest graph of size >= B
with padding requests that have no context and write nothing (see `BatchLayout.padded`).
The graph's inputs are persistent device tensors, refilled by one copy before each replay.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from chunkserve.model.batch import BatchLayout, BatchTensors, DeviceStager
from chunkserve.model.models.interface import CausalLM

MAX_CAPTURE_SIZE = 256  # larger decode batches run eagerly: launch overhead is amortized there


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, cap), always including the limit."""
    limit = min(max_num_seqs, cap)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit + 1, 8))
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return sorted(set(sizes))


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: BatchTensors  # persistent: refilled before each replay
    hidden: torch.Tensor  # the captured forward's output buffer, [size, hidden]


class CUDAGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        stager: DeviceStager,
        sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
    ) -> None:
        assert model.attn.supports_cuda_graphs, "graphs need a graph-safe attention backend"
        self.model = model
        self.kv_caches = kv_caches
        self.stager = stager
        self.sizes = sorted(sizes)
        self.width = max_blocks_per_seq
        self.block_size = block_size
        self.graphs: dict[int, _Graph] = {}
        self._pool: object = None  # one memory pool shared by all sizes' graphs
        self.num_replays = 0  # decode steps served by a graph (tests and gpu_check read it)

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first: the smaller graphs then fit in memory the larger one already holds.
        for size in reversed(self.sizes):
            inputs = self.stager.allocate(self._empty_layout(size))
            meta = self.model.attn.build_metadata(inputs)
            # One eager run first: it compiles the Triton kernels and lets the allocator settle,
            # neither of which may happen during capture.
            self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, meta)
            replay, hidden = self._record(inputs, meta)
            self.graphs[size] = _Graph(replay, inputs, hidden)

    def _record(self, inputs: BatchTensors, meta: object) -> tuple[Callable[[], None], torch.Tensor]:
        """Captures one forward; returns its replay and its output buffer. (A test on the CPU
        swaps this for an eager re-run to check everything around the capture.)"""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        torch.cuda.synchronize()
        return graph.replay, hidden

    def _empty_layout(self, size: int) -> BatchLayout:
        none = np.zeros(0, dtype=np.int64)
        empty = BatchLayout(
            none, none, none, np.zeros(1, np.int64), none,
            np.zeros((0, self.width), np.int64), self.block_size,
        )
        return empty.padded(size, self.width)

    def run(self, layout: BatchLayout) -> torch.Tensor | None:
        """Hidden states of a decode-only step by graph replay; None if no graph fits it."""
        if not self.graphs or layout.max_query_len != 1 or layout.num_seqs > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= layout.num_seqs)
        g = self.graphs[size]
        self.stager.copy_into(layout.padded(size, self.width), g.inputs)
        g.replay()
        self.num_replays += 1
        return g.hidden[: layout.num_tokens]
