"""Layers in KV-cache groups over one block pool (vLLM V1's hybrid KV-cache manager).

A model whose layers all attend the same way (Llama, Qwen, ...) is one group: a block id then
holds one block of tokens for every layer, exactly as before groups existed.

A model that interleaves sliding-window layers with full-attention layers (Gemma 3: five local
layers to one global) gets one group per `group_size` layers of a kind. Every group has its own
block table per request, and all tables draw from the same pool, so a block id means "block of
tokens for `group_size` layers" whichever group holds it. A sliding-window group frees the blocks
that fall wholly out of its window as the request advances, which a single table for all layers
could not: the window layers' memory stays bounded while the global layers' grows.

`group_size` is the smallest count of layers of one kind (3 full layers and 15 sliding: groups
of 3, 1 full and 5 sliding), so that every group fills its pages: a kind whose count it does not
divide gets one partly empty group, memory wasted but never wrong.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    """Which layers share a block table, and each group's attention window."""

    windows: tuple[int | None, ...]  # per group: the sliding window, None for full attention
    layers: tuple[tuple[int, ...], ...]  # per group: its layer indices, ascending
    group_size: int  # layers per page: the KV tensors the runner allocates

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def slot_of_layer(self) -> dict[int, tuple[int, int]]:
        """layer index -> (group, slot within the group's page)."""
        return {layer: (g, slot) for g, group in enumerate(self.layers)
                for slot, layer in enumerate(group)}

    def blocks_per_token_bound(self, block_size: int, max_tokens: int, chunk: int) -> int:
        """Blocks a request of `max_tokens` tokens holds at most, over all groups, when its
        chunks are at most `chunk` tokens: what the capacity estimates use."""
        total = 0
        for window in self.windows:
            tokens = max_tokens if window is None else min(max_tokens, window - 1 + chunk)
            total += -(-tokens // block_size) + (0 if window is None else 1)
        return total

    def max_tokens_within(self, block_size: int, num_blocks: int, chunk: int, upper: int) -> int:
        """The longest request (at most `upper` tokens) whose blocks_per_token_bound fits in
        `num_blocks`; 0 if not even one token does. The bound grows with the length, so a
        bisection finds it."""
        low, high = 0, upper
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_per_token_bound(block_size, mid, chunk) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low


def single_group(num_layers: int) -> KVCacheGroups:
    """Every layer full attention (or one window for all): one table per request."""
    return KVCacheGroups((None,), (tuple(range(num_layers)),), num_layers)


def group_layers(layer_windows: list[int | None]) -> KVCacheGroups:
    """Groups layers by window: one group if all layers attend alike, else groups of the
    smallest kind's count (see the module docstring)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_kind: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {i}: sliding window must be positive, got {window}")
        by_kind.setdefault(window, []).append(i)
    if len(by_kind) == 1:
        (window,) = by_kind
        return KVCacheGroups((window,), (tuple(range(len(layer_windows))),), len(layer_windows))
    size = min(len(layers) for layers in by_kind.values())
    windows: list[int | None] = []
    groups: list[tuple[int, ...]] = []
    # Full attention first: group 0 is the one whose prefix-cache hit is the longest candidate.
    for window in sorted(by_kind, key=lambda w: (w is not None, w or 0)):
        layers = by_kind[window]
        for start in range(0, len(layers), size):
            windows.append(window)
            groups.append(tuple(layers[start:start + size]))
    return KVCacheGroups(tuple(windows), tuple(groups), size)
