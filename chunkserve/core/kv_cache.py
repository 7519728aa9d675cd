"""Paged KV-cache bookkeeping: which block holds which request's tokens. No tensors here.

The runner owns the tensors (per layer `[num_blocks, block_size, kv_heads, head_dim]`); this
module only hands out block ids. Blocks are allocated incrementally, as chunks are scheduled, so
a request holds `ceil(tokens / block_size)` blocks and at most its last block is partly empty.

With prefix caching (vLLM V1's automatic prefix caching) a *full* block is indexed by the hash
of its whole prefix once its KV is scheduled to be written, and may then sit in several
requests' tables at once (a reference count says how many). Only full blocks are ever shared
and a request only ever writes past its own hit, so the last, partly filled block is always
private: nothing is ever copied on write.
"""
from __future__ import annotations

from dataclasses import dataclass

from chunkserve.core.block_hash import BlockHash, extend_block_hashes
from chunkserve.core.prefix_cache import PrefixCache
from chunkserve.core.request import Request


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


@dataclass
class KVCacheStats:
    num_blocks: int
    num_used_blocks: int  # referenced by some request (evictable cached blocks count as free)
    num_free_blocks: int
    usage: float  # 0..1, like vllm:kv_cache_usage_perc
    internal_fragmentation: int  # allocated slots minus tokens stored


@dataclass
class PrefixCacheStats:
    """Cumulative lookups, counted once per admission: `queries` and `hits` are tokens
    (vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Tokens whose KV is (or is being, this step) written; for the fragmentation stat,
        # with running totals so that stats() does not walk every table each step.
        self._num_stored: dict[str, int] = {}
        self._total_stored = 0
        self._total_table_blocks = 0
        # Leading blocks of each table already offered to the index (so each is hashed once).
        self._num_indexed: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for the request to hold `num_tokens` tokens in total."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's hashes of its first `num_blocks` full blocks (computed once, kept on
        the request, as vLLM does)."""
        return extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, num_blocks,
            request.cache_extra_keys,
        )

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        Takes no reference (pass the result to `allocate_slots`). Never the whole request: the
        last token must be computed to have a logit to sample from, so a request whose every
        block is cached recomputes its last block, as vLLM does.

        Nor a request that asked for prompt logprobs and has not had them yet (no output token):
        a skipped position would have no logits. Its blocks are still indexed for others.
        """
        if not self.enable_caching or request.request_id in self.block_tables:
            return []
        if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self.block_hashes(request, max_blocks):
            block = self.pool.cache.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        expected_tokens: int | None = None,
        computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Grows the request's table to hold `num_tokens` tokens; None if the pool is short.

        `computed_blocks` (a new request's prefix-cache hit) start the table, each taking a
        reference. `expected_tokens` (prompt + max output) is a placement hint only: see
        BlockPool. All or nothing: on None no reference or block was taken.
        """
        table = self.block_tables.get(request_id)
        if not computed_blocks and table and len(table) * self.block_size >= num_tokens:
            # Most calls: a decode whose last block still has room. Nothing to take.
            self._set_stored(request_id, num_tokens)
            return []
        hits = computed_blocks or []
        assert not hits or request_id not in self.block_tables, "hits only start a table"
        need = max(0, self.blocks_needed(request_id, num_tokens) - len(hits))
        # A hit on an evictable block takes it out of the free pool too.
        revived = sum(1 for b in hits if self.pool.ref_cnt[b] == 0) if hits else 0
        if need + revived > self.pool.num_free:
            return None
        table = self.block_tables.setdefault(request_id, [])
        if hits:
            self.pool.touch(hits)
            table.extend(hits)
            self._num_indexed[request_id] = len(hits)
        room = None if expected_tokens is None else -(-expected_tokens // self.block_size)
        new = self.pool.take(need, table[-1] if table else None, room)
        table.extend(new)
        self._total_table_blocks += len(hits) + len(new)
        self._set_stored(request_id, num_tokens)
        return new

    def _set_stored(self, request_id: str, num_tokens: int) -> None:
        self._total_stored += num_tokens - self._num_stored.get(request_id, 0)
        self._num_stored[request_id] = num_tokens

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Indexes the request's blocks that are full once its first `num_tokens` tokens have
        KV. Called when those tokens are scheduled: a later request may then hit them even in
        the same step, which is safe because every layer writes the step's K/V into the cache
        before any request's attention reads it."""
        if not self.enable_caching:
            return
        rid = request.request_id
        full = num_tokens // self.block_size
        start = self._num_indexed.get(rid, 0)
        if full <= start:  # most calls: a decode inside a block already indexed
            return
        table = self.block_tables[rid]
        full = min(full, len(table))
        if full <= start:
            return
        hashes = self.block_hashes(request, full)
        for i in range(start, full):
            self.pool.cache.insert(table[i], hashes[i])
        self._num_indexed[rid] = full

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.requests += 1
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def free(self, request_id: str) -> list[int]:
        table = self.block_tables.pop(request_id, [])
        self._total_stored -= self._num_stored.pop(request_id, 0)
        self._total_table_blocks -= len(table)
        self._num_indexed.pop(request_id, None)
        # Reverse order, as vLLM does: a request's tail blocks, the least likely to be shared,
        # become evictable first, so they are evicted before its head blocks.
        self.pool.give_back(table[::-1])
        return table

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (vLLM's /reset_prefix_cache); running requests keep
        their blocks. Returns how many evictable blocks became empty."""
        # Tables indexed so far stay counted as indexed: re-offering their blocks would only
        # re-share blocks that are already computed, which is harmless but not "reset".
        return self.pool.reset_cache()

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - self.pool.num_free
        # Per request, the unused slots of its tables: shared blocks are full, so this is the
        # private last blocks' empty slots, never double-counted.
        slots = self._total_table_blocks * self.block_size
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_free_blocks=self.pool.num_free,
            usage=used / self.num_blocks,
            internal_fragmentation=slots - self._total_stored,
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
