"""Prefix caching in core/: block hashing, the LRU of evictable blocks, hit accounting in the
KV cache manager and the scheduler. Pure Python, no torch."""
from __future__ import annotations

import pytest

from chunkserve.config import CacheConfig, SchedulerConfig
from chunkserve.core.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from chunkserve.core.kv_cache import BlockPool, KVCacheManager
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.scheduler import Scheduler
from chunkserve.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0), 0.0, [2])


def _admit(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> list[int]:
    """What the scheduler does at admission: look up, allocate, index the computed blocks."""
    hits = kv.get_computed_blocks(req)
    n = req.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate_slots(req.request_id, n, computed_blocks=hits) is not None
    kv.cache_blocks(req, n)
    return hits.tables[0]  # one group: the hit's blocks


# ---- hashing --------------------------------------------------------------------------------
def test_hash_chains_parent_and_tokens() -> None:
    """Same tokens under different parents hash differently; the same prefix hashes the same."""
    a = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])


def test_extra_keys_change_the_hash() -> None:
    """Anything else that changes KV (a future LoRA id) keys the block too."""
    assert hash_block_tokens(ROOT_HASH, [1, 2]) != hash_block_tokens(ROOT_HASH, [1, 2], ("lora", 1))


def test_extend_hashes_only_full_blocks_and_is_incremental() -> None:
    """Only full blocks get a hash; extending keeps earlier hashes and chains new ones."""
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BS, 99)
    assert len(hashes) == 2  # 10 tokens: two full blocks of 4
    first = list(hashes)
    tokens += [10, 11]
    extend_block_hashes(hashes, tokens, BS, 99)
    assert hashes[:2] == first and len(hashes) == 3
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])


# ---- hit accounting -------------------------------------------------------------------------
def test_hit_at_exact_block_boundary() -> None:
    """A prompt that is a cached prefix plus more: every shared full block hits."""
    kv = KVCacheManager(16, BS)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    b = _req("b", list(range(8)) + [50, 51, 52])
    assert kv.get_computed_blocks(b).tables[0] == kv.block_tables["a"][:2]


def test_one_token_past_the_boundary_still_hits_the_full_blocks() -> None:
    """A cached block followed by one differing token: the block hits, the partial does not."""
    kv = KVCacheManager(16, BS)
    _admit(kv, _req("a", list(range(6))))  # one full block + 2 tokens
    b = _req("b", list(range(4)) + [99])
    assert kv.get_computed_blocks(b).tables[0] == [kv.block_tables["a"][0]]
    c = _req("c", [9] + list(range(1, 6)))  # differs in the first block: no hit at all
    assert not kv.get_computed_blocks(c)


def test_full_prompt_hit_recomputes_the_last_token() -> None:
    """A prompt that is entirely cached still computes its last block (for its logit)."""
    kv = KVCacheManager(16, BS)
    _admit(kv, _req("a", list(range(8))))
    again = _req("b", list(range(8)))
    hits = kv.get_computed_blocks(again)
    assert hits.num_blocks == 1  # 7 tokens may hit at most: one full block
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32).resolve(),
                      CacheConfig(block_size=BS), 16)
    for rid in ("x", "y"):
        sched.add_request(_req(rid, list(range(8))))
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    # y hit 4 tokens and computed 4: its chunk starts at the hit, block-aligned.
    (sr,) = [s for s in out.scheduled if s.request.request_id == "y"]
    assert (sr.start, sr.num_new_tokens) == (4, 4)
    assert sr.request.num_cached_tokens == 4


def test_hit_takes_references_and_freeing_keeps_the_hash() -> None:
    """A shared block has one reference per holder; freed, it stays cached and can be revived."""
    kv = KVCacheManager(16, BS)
    _admit(kv, _req("a", list(range(9))))
    shared = kv.block_tables["a"][:2]
    b = _req("b", list(range(8)) + [70])
    assert _admit(kv, b) == shared
    assert [kv.pool.ref_cnt[x] for x in shared] == [2, 2]
    kv.free("a")
    kv.free("b")
    assert all(kv.pool.ref_cnt[x] == 0 for x in shared)
    assert kv.stats().num_used_blocks == 0
    c = _req("c", list(range(8)) + [80])
    assert _admit(kv, c) == shared  # revived from the evictable list
    assert kv.pool.num_free == 16 - len(kv.block_tables["c"])


def test_eviction_is_least_recently_freed_first_and_drops_the_hash() -> None:
    """Empty blocks go first; then evictable ones in LRU order, each losing its hash."""
    kv = KVCacheManager(4, BS)
    _admit(kv, _req("a", [1] * 4 + [9]))  # blocks: cached full + partial
    _admit(kv, _req("b", [2] * 4 + [9]))
    a_full, b_full = kv.block_tables["a"][0], kv.block_tables["b"][0]
    kv.free("a")  # a's full block freed first: least recently freed
    kv.free("b")
    assert kv.pool.cache.num_evictable == 2 and kv.pool.num_free == 4
    new = kv.pool.take(3, None)  # two empty (the partials) then the LRU cached block: a's
    assert a_full in new and b_full not in new
    assert not kv.get_computed_blocks(_req("x", [1] * 4 + [5]))  # a's prefix is gone
    assert kv.get_computed_blocks(_req("y", [2] * 4 + [5])).tables[0] == [b_full]


def test_a_hit_refreshes_recency() -> None:
    """Reviving a block and freeing it again makes it the most recently freed."""
    kv = KVCacheManager(3, BS)
    _admit(kv, _req("x", [1] * 4))
    _admit(kv, _req("y", [2] * 4))
    x_block, y_block = kv.block_tables["x"][0], kv.block_tables["y"][0]
    kv.free("x")
    kv.free("y")  # LRU order: x, y
    assert _admit(kv, _req("z", [1] * 4 + [9])) == [x_block]  # revives x, takes the empty one
    kv.free("z")  # LRU order now: y, x
    new = kv.pool.take(2, None)  # the empty block, then the least recently freed: y
    assert y_block in new and x_block not in new


def test_allocation_counts_revived_blocks_against_free_space() -> None:
    """Reviving an evictable block uses free space: all or nothing still holds."""
    kv = KVCacheManager(3, BS)
    _admit(kv, _req("a", [1] * 8 + [2]))  # all 3 blocks, two cached
    kv.free("a")
    _admit(kv, _req("b", [5]))  # takes the one empty block
    c = _req("c", [1] * 8 + [3, 3, 3, 3, 3])  # hits 2 evictable, needs 2 more: 1 short
    hits = kv.get_computed_blocks(c)
    assert hits.num_blocks == 2
    assert kv.allocate_slots("c", c.num_tokens, computed_blocks=hits) is None
    assert all(kv.pool.ref_cnt[b] == 0 for b in hits.cached_blocks()) and "c" not in kv.block_tables


def test_duplicate_content_keeps_the_first_copy_indexed() -> None:
    """Two requests computing the same block at once: only the first block is indexed; the
    second copy stays private and is freed as an ordinary block."""
    kv = KVCacheManager(8, BS)
    a, b = _req("a", [4] * 5), _req("b", [4] * 5)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 5)
    kv.cache_blocks(a, 5)
    kv.cache_blocks(b, 5)
    assert kv.pool.cache.lookup(a.block_hashes[0]) == kv.block_tables["a"][0]
    kv.free("b")
    assert kv.pool.cache.num_evictable == 0


def test_disabled_caching_never_hits() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    _admit(kv, _req("a", list(range(8))))
    assert not kv.get_computed_blocks(_req("b", list(range(9))))
    kv.free("a")
    assert kv.pool.cache.num_evictable == 0 and len(kv.pool.cache) == 0


def test_reset_forgets_every_prefix_but_keeps_running_blocks() -> None:
    kv = KVCacheManager(8, BS)
    _admit(kv, _req("a", list(range(9))))
    _admit(kv, _req("b", [7] * 5))
    kv.free("b")
    assert kv.reset_prefix_cache() == 1
    assert not kv.get_computed_blocks(_req("c", list(range(9))))
    assert kv.pool.cache.num_evictable == 0
    kv.free("a")
    assert kv.pool.num_free == 8 and all(c == 0 for c in kv.pool.ref_cnt)


def test_pool_double_free_of_shared_block_is_caught() -> None:
    pool = BlockPool(2)
    (b,) = pool.take(1, None)
    pool.touch([b])
    pool.give_back([b, b])
    with pytest.raises(AssertionError):
        pool.give_back([b])


# ---- scheduler ------------------------------------------------------------------------------
def _scheduler(budget: int, num_blocks: int = 64, **cache: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(config.resolve(), CacheConfig(block_size=BS, **cache), num_blocks)  # type: ignore[arg-type]


def _run(sched: Scheduler) -> None:
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})


def test_budget_counts_only_uncached_tokens_and_chunks_start_after_the_hit() -> None:
    """A 20-token prompt with 16 cached: one step of 4 tokens, from position 16."""
    sched = _scheduler(budget=6)
    sched.add_request(_req("a", list(range(20)), max_tokens=1))
    _run(sched)
    sched.add_request(_req("b", list(range(20)), max_tokens=1))
    out = sched.schedule()
    (sr,) = out.scheduled
    assert (sr.start, sr.num_new_tokens, sr.samples) == (16, 4, True)
    assert out.prefix_cache_queries == 20 and out.prefix_cache_hits == 16
    assert out.prefix_cache_stats is not None and out.prefix_cache_stats.queries == 40


def test_num_cached_tokens_is_the_hit_at_first_schedule() -> None:
    """A recompute preemption re-hits more of the cache, but the client's number stays the hit
    of the first schedule."""
    sched = _scheduler(budget=64)
    sched.add_request(_req("a", list(range(8)), max_tokens=1))
    _run(sched)
    sched.add_request(_req("b", list(range(12)) + [99], max_tokens=8))
    out = sched.schedule()
    b = sched.requests["b"]
    assert b.num_cached_tokens == 8 and out.prefix_cache_hits == 8
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    sched._preempt(b)
    out = sched.schedule()
    assert out.prefix_cache_hits == 12  # its own third block is cached now
    assert b.num_computed_tokens == b.num_tokens
    assert b.num_cached_tokens == 8


def test_same_step_admissions_share_blocks_being_computed() -> None:
    """A request admitted after another in the same step hits the blocks that one is about to
    compute (every layer writes the step's K/V before attention reads it)."""
    sched = _scheduler(budget=64)
    sched.add_request(_req("a", list(range(12)), max_tokens=1))
    sched.add_request(_req("b", list(range(12)) + [99], max_tokens=1))
    out = sched.schedule()
    a, b = (s for s in out.scheduled)
    assert b.block_tables[0][:3] == a.block_tables[0][:3] and (b.start, b.num_new_tokens) == (12, 1)


def test_no_chunk_policy_admits_the_uncached_remainder_in_one_step() -> None:
    config = SchedulerConfig(scheduler="prefill-first", max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(config.resolve(), CacheConfig(block_size=BS), 64)
    sched.add_request(_req("a", list(range(30)), max_tokens=1))
    _run(sched)
    sched.add_request(_req("b", list(range(30)), max_tokens=1))
    (sr,) = sched.schedule().scheduled
    assert (sr.start, sr.num_new_tokens) == (28, 2)


def test_finished_and_aborted_requests_leave_no_references() -> None:
    sched = _scheduler(budget=8)
    for i in range(4):
        sched.add_request(_req(f"r{i}", list(range(18)) + [i], max_tokens=3))
    sched.schedule()
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    _run(sched)
    assert all(c == 0 for c in sched.kv.pool.ref_cnt)
    assert sched.kv.stats().num_used_blocks == 0
