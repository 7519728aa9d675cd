"""The longest prefix-cache hit that every KV-cache group can serve (vLLM V1's hybrid rule).

A hit of L blocks means the request skips its first L·block_size tokens, so its next token, at
position t = L·block_size, must find in every group what it attends to:
- a full-attention group: all L blocks;
- a sliding-window group of window W: only the blocks holding positions t − W + 1 .. t − 1;
  the earlier ones are not needed (and are holes in its table, as if freed).
Full groups are prefix-closed (a shorter hit of a cached run is still cached), sliding groups
are not (shortening a hit moves its window onto blocks that may be gone), so the length is
lowered until every group agrees.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A table entry whose block was freed (out of a sliding window) or never needed (a hit's head).
NULL_BLOCK = -1

# (group, block index) -> the cached block holding it, or None.
Lookup = Callable[[int, int], int | None]


@dataclass(frozen=True)
class PrefixHit:
    """Per group, the table a hit starts with (NULL_BLOCK where the group needs nothing)."""

    tables: tuple[list[int], ...]
    num_blocks: int  # blocks of tokens skipped: the same in every group

    def __bool__(self) -> bool:
        return self.num_blocks > 0

    def cached_blocks(self) -> list[int]:
        return [b for table in self.tables for b in table if b != NULL_BLOCK]


def first_needed_block(window: int | None, position: int, block_size: int) -> int:
    """Index of the first block a query at `position` (or any later one) may read."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def no_hit(num_groups: int) -> PrefixHit:
    return PrefixHit(tuple([] for _ in range(num_groups)), 0)


def find_hit(lookup: Lookup, windows: Sequence[int | None], block_size: int,
             max_blocks: int) -> PrefixHit:
    length = max_blocks
    for g, window in enumerate(windows):
        if window is None:
            run = 0
            while run < length and lookup(g, run) is not None:
                run += 1
            length = run
    changed = True
    while changed and length:
        changed = False
        for g, window in enumerate(windows):
            if window is not None:
                fits = _sliding_hit(lookup, g, window, block_size, length)
                if fits < length:
                    length, changed = fits, True
    return _tables(lookup, windows, block_size, length)


def _sliding_hit(lookup: Lookup, g: int, window: int, block_size: int, length: int) -> int:
    """The longest hit of at most `length` blocks whose window blocks group g has cached.

    Scans down from the top keeping the run of cached blocks that ends at `end`: the first
    time the run reaches back to the window's first block of a hit ending at `end`, that is it.
    """
    end = length
    for i in range(length - 1, -1, -1):
        if lookup(g, i) is None:
            end = i
        elif i <= first_needed_block(window, end * block_size, block_size):
            return end
    return 0


def _tables(lookup: Lookup, windows: Sequence[int | None], block_size: int,
            length: int) -> PrefixHit:
    tables = []
    for g, window in enumerate(windows):
        first = first_needed_block(window, length * block_size, block_size) if length else 0
        table = [NULL_BLOCK] * first
        for i in range(first, length):
            block = lookup(g, i)
            assert block is not None
            table.append(block)
        tables.append(table)
    return PrefixHit(tuple(tables), length)
