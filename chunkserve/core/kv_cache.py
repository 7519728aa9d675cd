"""Paged KV-cache bookkeeping: which block holds which request's tokens. No tensors here.

The runner owns the tensors; this module only hands out block ids from one `BlockPool`. Blocks
are allocated incrementally, as chunks are scheduled, so a request holds `ceil(tokens /
block_size)` blocks and at most its last block is partly empty.

Layers are in KV-cache groups (core/kv_groups.py): one for most models, several for a model
that mixes sliding-window and full-attention layers. Each request has one table per group, all
the same length; a sliding-window group's table has holes (NULL_BLOCK) where its blocks fell
wholly out of the window and went back to the pool, freed before every allocation, between the
chunks of one prompt too, so such a group holds at most ceil((W - 1 + chunk) / block_size) + 1
blocks of a request. No ring buffer: a block keeps its place, so prefix caching still works.

With prefix caching (vLLM V1's automatic prefix caching) a *full* block is indexed by the hash
of its whole prefix (and its group) once its KV is scheduled to be written, and may then sit in
several requests' tables at once (a reference count says how many). Only full blocks are ever
shared and a request only ever writes past its own hit, so the last, partly filled block is
always private: nothing is ever copied on write.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from chunkserve.core.block_hash import BlockHash, extend_block_hashes
from chunkserve.core.block_pool import BlockPool
from chunkserve.core.kv_groups import KVCacheGroups, single_group
from chunkserve.core.prefix_hit import (
    NULL_BLOCK, PrefixHit, find_hit, first_needed_block, no_hit,
)
from chunkserve.core.request import Request

__all__ = ["BlockPool", "KVCacheManager", "KVCacheStats", "NULL_BLOCK", "PrefixCacheStats",
           "PrefixHit", "SwapSpace"]


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




class _FirstGroupTables(Mapping[str, list[int]]):
    """request id -> its first group's table: the whole table of a one-group model."""

    def __init__(self, tables: dict[str, list[list[int]]]) -> None:
        self._tables = tables

    def __getitem__(self, request_id: str) -> list[int]:
        return self._tables[request_id][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)


@dataclass(frozen=True)
class _SwappedShape:
    """A swapped-out request's tables: where each group's live blocks began, and how long they
    were. Swap-in rebuilds exactly these slots, so host block i lands where it came from."""

    first_live: tuple[int, ...]
    num_blocks: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: KVCacheGroups | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups or single_group(1)
        self.windows = self.groups.windows
        self.pool = BlockPool(num_blocks)
        # Per request, one table per group, all the same length (holes included).
        self.tables: dict[str, list[list[int]]] = {}
        self._first_live: dict[str, list[int]] = {}  # per group: the first entry not a hole
        # Tokens whose KV is (or is being, this step) written; for the fragmentation stat,
        # with running totals so that stats() does not walk every table each step.
        self._num_stored: dict[str, int] = {}
        self._total_stored = 0
        self._total_table_blocks = 0  # over all groups, holes included
        # Leading blocks of each table already offered to the index (so each is hashed once).
        self._num_indexed: dict[str, int] = {}
        self._swapped: dict[str, _SwappedShape] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_tables(self) -> Mapping[str, list[int]]:
        """The first group's table of each request (a one-group model's only table)."""
        return _FirstGroupTables(self.tables)

    def blocks_needed(self, request_id: str, num_tokens: int, num_computed: int = 0) -> int:
        """Extra blocks, over all groups, for the request to hold `num_tokens` tokens in total
        once `num_computed` are computed (a sliding-window group needs only its window)."""
        tables = self.tables.get(request_id)
        have = len(tables[0]) if tables else 0
        target = -(-num_tokens // self.block_size)
        return sum(max(0, target - max(have, first_needed_block(w, num_computed,
                                                                self.block_size)))
                   for w in self.windows)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's hashes of its first `num_blocks` full blocks (computed once, kept on
        the request, as vLLM does)."""
        return extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, num_blocks,
            request.cache_extra_keys,
        )

    @staticmethod
    def _key(group: int, block_hash: BlockHash) -> BlockHash:
        # Each group caches its own KV of the same tokens; group 0 keeps the plain hash.
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request that every group can serve.

        Takes no reference (pass the result to `allocate_slots`). Never the whole request: the
        last token must be computed to have a logit to sample from, so a request whose every
        block is cached recomputes its last block, as vLLM does.

        Nor a request that asked for prompt logprobs and has not had them yet (no output token):
        a skipped position would have no logits. Its blocks are still indexed for others.
        """
        if (not self.enable_caching or request.request_id in self.tables
                or (request.sampling_params.prompt_logprobs is not None
                    and not request.output_token_ids)):
            return no_hit(len(self.windows))
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, max_blocks)
        cache = self.pool.cache

        def lookup(group: int, i: int) -> int | None:
            return cache.lookup(self._key(group, hashes[i]))

        return find_hit(lookup, self.windows, self.block_size, max_blocks)

    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        expected_tokens: int | None = None,
        computed_blocks: PrefixHit | None = None,
        num_computed: int | None = None,
    ) -> list[int] | None:
        """Grows the request's tables to hold `num_tokens` tokens; None if the pool is short.

        `num_computed`: tokens already computed, the step's first position. Sliding-window
        groups first free what their window left behind, and a new table needs blocks only
        from its window on (None: keep everything, as a full-attention group does).
        `computed_blocks` (a new request's prefix-cache hit) start the tables, each taking a
        reference. `expected_tokens` (prompt + max output) is a placement hint only: see
        BlockPool. All or nothing: on None no reference or block was taken.
        """
        tables = self.tables.get(request_id)
        if tables is not None and num_computed is not None:
            self._free_outside_windows(request_id, num_computed)
        target = -(-num_tokens // self.block_size)
        if not computed_blocks and tables and len(tables[0]) >= target:
            # Most calls: a decode whose last block still has room. Nothing to take.
            self._set_stored(request_id, num_tokens)
            return []
        assert not computed_blocks or tables is None, "hits only start a table"
        plan = self._plan(request_id, target, computed_blocks, num_computed or 0)
        hits = computed_blocks.cached_blocks() if computed_blocks else []
        # A hit on an evictable block takes it out of the free pool too.
        revived = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if sum(n for _, n in plan) + revived > self.pool.num_free:
            return None
        if tables is None:
            tables = self._start_tables(request_id, [head for head, _ in plan], computed_blocks)
        room = None if expected_tokens is None else -(-expected_tokens // self.block_size)
        new: list[int] = []
        for (_, n), table, window in zip(plan, tables, self.windows):
            if n:
                last = table[-1] if table and table[-1] != NULL_BLOCK else None
                grown = self.pool.take(n, last, self._room(room, window))
                table.extend(grown)
                new.extend(grown)
        self._total_table_blocks += len(new)
        self._set_stored(request_id, num_tokens)
        return new

    def _plan(self, request_id: str, target: int, hit: PrefixHit | None,
              num_computed: int) -> list[tuple[list[int], int]]:
        """Per group: the entries a new table starts with, and how many blocks to take."""
        tables = self.tables.get(request_id)
        if tables is not None:
            return [([], max(0, target - len(t))) for t in tables]
        shape = self._swapped.get(request_id)
        plan = []
        for g, window in enumerate(self.windows):
            if hit:
                head = list(hit.tables[g])
            elif shape is not None:  # rebuilt slot for slot: see restored_blocks()
                head = [NULL_BLOCK] * shape.first_live[g]
                target = max(target, shape.num_blocks)
            else:
                head = [NULL_BLOCK] * first_needed_block(window, num_computed, self.block_size)
            plan.append((head, max(0, target - len(head))))
        return plan

    def _start_tables(self, request_id: str, heads: list[list[int]],
                      hit: PrefixHit | None) -> list[list[int]]:
        tables = [list(head) for head in heads]
        self.tables[request_id] = tables
        self._first_live[request_id] = [_num_holes(t) for t in tables]
        self._total_table_blocks += sum(len(t) for t in tables)
        if hit:
            self.pool.touch(hit.cached_blocks())
            self._num_indexed[request_id] = hit.num_blocks
        return tables

    def _room(self, room: int | None, window: int | None) -> int | None:
        # A window group's run never outgrows its window: the head is freed as the tail grows.
        if room is None or window is None:
            return room
        return min(room, -(-window // self.block_size) + 1)

    def _free_outside_windows(self, request_id: str, num_computed: int) -> None:
        """Gives back each sliding-window group's blocks that lie wholly before the window of
        the next token (position num_computed): no query from now on can attend to them."""
        tables, first_live = self.tables[request_id], self._first_live[request_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table = tables[g]
            first = min(first_needed_block(window, num_computed, self.block_size), len(table))
            if first <= first_live[g]:
                continue
            gone = table[first_live[g]:first]
            table[first_live[g]:first] = [NULL_BLOCK] * len(gone)
            first_live[g] = first
            self.pool.give_back(gone[::-1])

    def live_blocks(self, request_id: str) -> list[int]:
        """The request's blocks that hold KV, group after group (what a swap-out copies)."""
        tables = self.tables.get(request_id)
        if tables is None:
            return []
        first_live = self._first_live[request_id]
        return [b for g, t in enumerate(tables) for b in t[first_live[g]:]]

    def restored_blocks(self, request_id: str) -> list[int]:
        """After a swapped-out request's allocation: the device blocks its `live_blocks` at
        swap-out map to, in the same order."""
        shape = self._swapped.pop(request_id)
        tables = self.tables[request_id]
        return [b for g, t in enumerate(tables) for b in t[shape.first_live[g]:shape.num_blocks]]

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
        tables = self.tables[rid]
        full = min(full, len(tables[0]))
        if full <= start:
            return
        hashes = self.block_hashes(request, full)
        for g, table in enumerate(tables):
            for i in range(max(start, self._first_live[rid][g]), full):  # holes: nothing
                self.pool.cache.insert(table[i], self._key(g, hashes[i]))
        self._num_indexed[rid] = full

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.requests += 1
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def free(self, request_id: str, keep_shape: bool = False) -> list[int]:
        """Gives back every group's blocks; returns them (`live_blocks` order). `keep_shape`:
        the request was swapped out, and its next allocation rebuilds the same slots."""
        live = self.live_blocks(request_id)
        tables = self.tables.pop(request_id, None)
        first_live = self._first_live.pop(request_id, None)
        if keep_shape and tables is not None and first_live is not None:
            self._swapped[request_id] = _SwappedShape(tuple(first_live), len(tables[0]))
        elif not keep_shape:
            self._swapped.pop(request_id, None)
        self._total_stored -= self._num_stored.pop(request_id, 0)
        self._num_indexed.pop(request_id, None)
        if tables is None or first_live is None:
            return []
        self._total_table_blocks -= sum(len(t) for t in tables)
        # Reverse order, as vLLM does: a request's tail blocks, the least likely to be shared,
        # become evictable first, so they are evicted before its head blocks.
        for table, first in zip(tables, first_live):
            self.pool.give_back(table[first:][::-1])
        return live

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (vLLM's /reset_prefix_cache); running requests keep
        their blocks. Returns how many evictable blocks became empty."""
        # Tables indexed so far stay counted as indexed: re-offering their blocks would only
        # re-share blocks that are already computed, which is harmless but not "reset".
        return self.pool.reset_cache()

    def check_consistency(self, live_requests: set[str]) -> list[str]:
        """What does not add up, if anything: tables only of live requests, each block's
        reference count equal to the tables holding it, and every block either held or free."""
        problems = [f"{rid} holds blocks but is gone" for rid in self.tables.keys() - live_requests]
        held = [0] * self.num_blocks
        for tables in self.tables.values():
            for table in tables:
                for block in table:
                    if block != NULL_BLOCK:
                        held[block] += 1
        pool = self.pool
        wrong = [b for b in range(self.num_blocks) if held[b] != pool.ref_cnt[b]]
        problems += [f"block {b}: {pool.ref_cnt[b]} references, {held[b]} tables"
                     for b in wrong[:3]]
        num_held = sum(1 for n in held if n)
        if num_held + pool.num_free != self.num_blocks:
            problems.append(f"{num_held} blocks held + {pool.num_free} free != {self.num_blocks}")
        return problems

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - self.pool.num_free
        # Per request and group, the unused slots of its table: shared blocks and holes are
        # whole blocks of stored tokens, so this is the private last blocks' empty slots.
        slots = self._total_table_blocks * self.block_size
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_free_blocks=self.pool.num_free,
            usage=used / self.num_blocks,
            internal_fragmentation=slots - len(self.windows) * self._total_stored,
        )


def _num_holes(table: list[int]) -> int:
    n = 0
    while n < len(table) and table[n] == NULL_BLOCK:
        n += 1
    return n


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
