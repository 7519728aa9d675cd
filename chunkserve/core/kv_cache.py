"""Paged KV-cache bookkeeping: which block holds which request's tokens. No tensors here.

The runner owns the tensors (per layer `[num_blocks, block_size, kv_heads, head_dim]`); this
module only hands out block ids. Blocks are allocated incrementally, as chunks are scheduled, so
a request holds `ceil(tokens / block_size)` blocks and at most its last block is partly empty.
"""
from __future__ import annotations

from dataclasses import dataclass


class BlockPool:
    """A fixed set of block ids with a free set.

    Placement keeps each request's blocks consecutive where it can, because the runner then
    attends over a *view* of the cache instead of copying the blocks together every step:
    growth takes the block right after the request's last one; a new request is placed
    next-fit at the start of a free run long enough for its expected final size (`room`), so
    that its later growth finds the following ids still free. This only chooses *which* free
    ids to hand out: nothing is reserved, and under pressure any free block is used.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: set[int] = set(range(num_blocks))
        # Lowest free id is found by scanning up from this hint; ids below it are all in use.
        self._low = 0
        self._cursor = 0  # where the next-fit search for a new request's run starts

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int, after: int | None, room: int | None = None) -> list[int]:
        assert n <= len(self._free), "caller must check capacity first"
        nxt = None if after is None else after + 1
        if nxt is None and room is not None:
            nxt = self._find_run(max(room, n)) if room <= len(self._free) else None
            if nxt is None:
                nxt = self._find_run(n)
            if nxt is not None:
                self._cursor = nxt + max(room, n)
        out: list[int] = []
        for _ in range(n):
            if nxt is not None and nxt in self._free:
                block = nxt
            else:
                while self._low not in self._free:
                    self._low += 1
                block = self._low
            self._free.remove(block)
            out.append(block)
            nxt = block + 1
        return out

    def _find_run(self, length: int) -> int | None:
        """First id of `length` consecutive free ids, from the cursor on, then from 0.

        O(num_blocks) at worst, and only called when a request gets its first block.
        """
        for lo in (self._cursor, 0):
            run = 0
            for block in range(lo, self.num_blocks):
                run = run + 1 if block in self._free else 0
                if run == length:
                    return block - length + 1
        return None

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            assert block not in self._free, f"double free of block {block}"
            self._free.add(block)
            if block < self._low:
                self._low = block


@dataclass
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    usage: float  # 0..1, like vllm:kv_cache_usage_perc
    internal_fragmentation: int  # allocated slots minus tokens stored


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Tokens whose KV is (or is being, this step) written; for the fragmentation stat.
        self._num_stored: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for the request to hold `num_tokens` tokens in total."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def allocate_slots(
        self, request_id: str, num_tokens: int, expected_tokens: int | None = None
    ) -> list[int] | None:
        """Grows the request's table to hold `num_tokens` tokens; None if the pool is short.

        `expected_tokens` (prompt + max output) is a placement hint only: see BlockPool.
        """
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free:
            return None
        table = self.block_tables.setdefault(request_id, [])
        room = None if expected_tokens is None else -(-expected_tokens // self.block_size)
        new = self.pool.take(need, table[-1] if table else None, room)
        table.extend(new)
        self._num_stored[request_id] = num_tokens
        return new

    def free(self, request_id: str) -> list[int]:
        table = self.block_tables.pop(request_id, [])
        self._num_stored.pop(request_id, None)
        # Reverse order, as vLLM does, so a request's tail blocks are reused first.
        self.pool.give_back(table[::-1])
        return table

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - self.pool.num_free
        slots = used * self.block_size
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_free_blocks=self.pool.num_free,
            usage=used / self.num_blocks,
            internal_fragmentation=slots - sum(self._num_stored.values()),
        )


class SwapSpace:
    """Host-side block ids for swap preemption; the runner holds the matching host tensors."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks) if num_blocks > 0 else None
        self.tables: dict[str, list[int]] = {}

    def can_swap_out(self, num_blocks: int) -> bool:
        return self.pool is not None and num_blocks <= self.pool.num_free

    def swap_out(self, request_id: str, device_blocks: list[int]) -> list[tuple[int, int]]:
        assert self.pool is not None
        host = self.pool.take(len(device_blocks), None)
        self.tables[request_id] = host
        return list(zip(device_blocks, host))

    def swap_in(self, request_id: str, device_blocks: list[int]) -> list[tuple[int, int]]:
        assert self.pool is not None
        host = self.tables.pop(request_id)
        self.pool.give_back(host)
        return list(zip(host, device_blocks))

    def free(self, request_id: str) -> None:
        host = self.tables.pop(request_id, None)
        if host and self.pool is not None:
            self.pool.give_back(host)

    @property
    def num_used(self) -> int:
        return 0 if self.pool is None else self.pool.num_blocks - self.pool.num_free
