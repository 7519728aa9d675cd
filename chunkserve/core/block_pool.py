"""The block pool: a fixed set of block ids with reference counts, shared by every request and
every KV-cache group (see kv_cache.py). No tensors here: the runner owns them."""
from __future__ import annotations

from chunkserve.core.prefix_cache import PrefixCache


class BlockPool:
    """A fixed set of block ids with reference counts: free blocks are either *empty* or
    *evictable* (unreferenced, but still holding a cached prefix's KV; see PrefixCache).

    Allocation uses empty blocks first, so cached KV survives as long as the pool allows, and
    only then evicts cached blocks, least recently freed first.

    Placement keeps each request's blocks consecutive where it can, because the runner then
    attends over a *view* of the cache instead of copying the blocks together every step:
    growth takes the block right after the request's last one; a new request is placed
    next-fit at the start of a free run long enough for its expected final size (`room`), so
    that its later growth finds the following ids still free. This only chooses *which* empty
    ids to hand out: nothing is reserved, and under pressure any free block is used.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))  # empty free blocks (no cached hash)
        self.ref_cnt: list[int] = [0] * num_blocks
        self.cache = PrefixCache()
        # Lowest free id is found by scanning up from this hint; ids below it are all in use.
        self._low = 0
        self._cursor = 0  # where the next-fit search for a new request's run starts

    @property
    def num_free(self) -> int:
        return len(self._free) + self.cache.num_evictable

    def take(self, n: int, after: int | None, room: int | None = None) -> list[int]:
        assert n <= self.num_free, "caller must check capacity first"
        nxt = None if after is None else after + 1
        if nxt is None and room is not None and self._free:
            nxt = self._find_run(max(room, n)) if room <= len(self._free) else None
            if nxt is None:
                nxt = self._find_run(n)
            if nxt is not None:
                self._cursor = nxt + max(room, n)
        out: list[int] = []
        for _ in range(n):
            if not self._free:
                block = self.cache.evict_lru()
            elif nxt is not None and nxt in self._free:
                block = nxt
            else:
                while self._low not in self._free:
                    self._low += 1
                block = self._low
            self._free.discard(block)
            self.ref_cnt[block] = 1
            out.append(block)
            nxt = block + 1
        return out

    def touch(self, blocks: list[int]) -> None:
        """Takes one more reference to each (cached) block: a prefix-cache hit."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                self.cache.unpark(block)  # revived: no longer evictable
            self.ref_cnt[block] += 1

    def _find_run(self, length: int) -> int | None:
        """First id of `length` consecutive empty ids, from the cursor on, then from 0.

        O(num_blocks) at worst, and only called when a request gets its first block.
        """
        free = self._free
        if length > len(free):  # with prefix caching most free blocks are evictable
            return None
        for lo in (self._cursor, 0):
            start = lo
            while start + length <= self.num_blocks:
                # Check the window from its end: a used block at `last` rules out every window
                # that contains it, so the next candidate starts right after it.
                last = start + length - 1
                while last >= start and last in free:
                    last -= 1
                if last < start:
                    return start
                start = last + 1
        return None

    def give_back(self, blocks: list[int]) -> None:
        """Drops one reference to each block; a block nobody holds any more becomes free,
        keeping its cached hash (evictable, most recent last) if it has one."""
        for block in blocks:
            assert self.ref_cnt[block] > 0, f"double free of block {block}"
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block]:
                continue
            if self.cache.is_cached(block):
                self.cache.park(block)
            else:
                self._release_empty(block)

    def _release_empty(self, block: int) -> None:
        self._free.add(block)
        if block < self._low:
            self._low = block

    def reset_cache(self) -> int:
        """Forgets every cached hash; returns how many evictable blocks became empty."""
        freed = self.cache.clear()
        for block in freed:
            self._release_empty(block)
        return len(freed)
