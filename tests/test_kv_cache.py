"""Paged KV-cache bookkeeping: BlockPool, KVCacheManager, SwapSpace, and block accounting
under random scheduler workloads (a hypothesis property test). Pure Python, no torch."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chunkserve.config import CHUNKED_SCHEDULERS, CacheConfig, SchedulerConfig
from chunkserve.core.kv_cache import NULL_BLOCK, BlockPool, KVCacheManager, SwapSpace
from chunkserve.core.kv_groups import KVCacheGroups
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.core.scheduler import Scheduler
from chunkserve.sampling_params import SamplingParams

POLICIES = ("decode-first", "vllm-v1", "prefill-first", "orca")
TOKEN = 7  # what the fake runner always samples
EOS = 2  # never sampled, so requests run to max_tokens unless stopped from outside


# ---- BlockPool ------------------------------------------------------------------------------
def test_pool_rejects_empty() -> None:
    """A pool must have at least one block."""
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_takes_lowest_ids_then_reuses_freed_ones() -> None:
    """Without a hint the pool hands out the lowest free ids; freed ids become available again."""
    pool = BlockPool(8)
    assert pool.take(3, None) == [0, 1, 2]
    assert pool.num_free == 5
    pool.give_back([1])
    assert pool.take(2, None) == [1, 3]
    assert pool.num_free == 4


def test_pool_prefers_block_after_hint() -> None:
    """`after` makes the pool continue a run of consecutive ids when the next id is free."""
    pool = BlockPool(8)
    pool.take(2, None)  # 0, 1
    assert pool.take(2, after=4) == [5, 6]
    # 7 is free and follows 6; then 8 does not exist, so it falls back to the lowest free id.
    assert pool.take(2, after=6) == [7, 2]


def test_pool_double_free_is_caught() -> None:
    """Returning a block twice is a bookkeeping bug and trips an assertion."""
    pool = BlockPool(4)
    blocks = pool.take(2, None)
    pool.give_back(blocks)
    with pytest.raises(AssertionError):
        pool.give_back(blocks[:1])


# ---- KVCacheManager -------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_incremental_allocation_holds_ceil_tokens_over_block_size(block_size: int) -> None:
    """Growing a request token by token keeps exactly ceil(tokens / block_size) blocks."""
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    for tokens in range(1, 60):
        new = kv.allocate_slots("a", tokens)
        assert new is not None
        assert len(kv.block_tables["a"]) == math.ceil(tokens / block_size)
        # A new block appears exactly when the previous ones are full.
        assert len(new) == (1 if (tokens - 1) % block_size == 0 else 0)


def test_blocks_needed_counts_only_extra_blocks() -> None:
    """blocks_needed is what is missing beyond the request's current table."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.blocks_needed("a", 9) == 3
    kv.allocate_slots("a", 5)
    assert kv.blocks_needed("a", 5) == 0
    assert kv.blocks_needed("a", 9) == 1
    assert kv.blocks_needed("a", 3) == 0  # never negative


def test_allocation_is_all_or_nothing() -> None:
    """When the pool is short, allocate_slots returns None and takes no block at all."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 8) == [0, 1]
    assert kv.allocate_slots("b", 12) is None  # needs 3, 2 free
    assert kv.pool.num_free == 2
    assert "b" not in kv.block_tables
    assert kv.allocate_slots("a", 20) is None  # needs 3 more
    assert kv.block_tables["a"] == [0, 1]
    assert kv.can_allocate(2) and not kv.can_allocate(3)


def test_free_returns_all_blocks() -> None:
    """free() gives every block back, forgets the table, and is a no-op for unknown ids."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 3)
    assert kv.free("a") == [0, 1, 2]
    assert "a" not in kv.block_tables
    assert kv.pool.num_free == 6
    assert kv.free("missing") == []
    kv.free("b")
    assert kv.pool.num_free == 8
    assert kv.stats().internal_fragmentation == 0


def test_growth_prefers_consecutive_ids() -> None:
    """A growing request continues after its last block when that id is free, else the lowest."""
    kv = KVCacheManager(num_blocks=16, block_size=1)
    kv.allocate_slots("a", 1)  # [0]
    kv.allocate_slots("b", 1)  # [1]
    kv.allocate_slots("a", 3)  # 1 is taken: lowest free is 2, then 3 follows it
    assert kv.block_tables["a"] == [0, 2, 3]
    kv.allocate_slots("a", 4)
    assert kv.block_tables["a"] == [0, 2, 3, 4]
    kv.free("b")
    kv.allocate_slots("c", 2)  # lowest free (1), then 5 (2..4 are a's)
    assert kv.block_tables["c"] == [1, 5]


def test_stats_usage_and_internal_fragmentation() -> None:
    """usage = used / total; internal fragmentation = allocated slots - stored tokens."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    stats = kv.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.usage) == (0, 10, 0.0)
    kv.allocate_slots("a", 5)  # 2 blocks, 8 slots, 5 tokens
    kv.allocate_slots("b", 4)  # 1 block, full
    stats = kv.stats()
    assert stats.num_blocks == 10
    assert stats.num_used_blocks == 3
    assert stats.num_free_blocks == 7
    assert stats.usage == pytest.approx(0.3)
    assert stats.internal_fragmentation == 3 * 4 - (5 + 4)
    kv.allocate_slots("a", 7)  # same blocks, more tokens stored
    assert kv.stats().internal_fragmentation == 12 - 11


# ---- SwapSpace ------------------------------------------------------------------------------
def test_swap_space_disabled_with_zero_blocks() -> None:
    """A zero-sized swap space can never swap out (the scheduler then recomputes)."""
    swap = SwapSpace(0)
    assert not swap.can_swap_out(0) and not swap.can_swap_out(1)
    assert swap.num_used == 0
    swap.free("anything")  # harmless


def test_swap_out_then_in_pairs_blocks_and_frees_host() -> None:
    """swap_out pairs (device, host); swap_in pairs the same host blocks with new device blocks."""
    swap = SwapSpace(4)
    assert swap.can_swap_out(3) and not swap.can_swap_out(5)
    pairs_out = swap.swap_out("a", [9, 3, 5])
    assert [d for d, _ in pairs_out] == [9, 3, 5]
    host = [h for _, h in pairs_out]
    assert len(set(host)) == 3 and swap.num_used == 3
    assert not swap.can_swap_out(2)
    pairs_in = swap.swap_in("a", [0, 1, 2])
    assert pairs_in == list(zip(host, [0, 1, 2]))
    assert swap.num_used == 0 and "a" not in swap.tables


def test_swap_free_releases_host_blocks() -> None:
    """Aborting a swapped-out request frees its host blocks."""
    swap = SwapSpace(4)
    swap.swap_out("a", [0, 1])
    swap.free("a")
    assert swap.num_used == 0
    swap.free("a")  # idempotent


# ---- property test: block accounting under random scheduler workloads ----------------------
def check_invariants(sched: Scheduler) -> None:
    """Every device block is referenced exactly as often as tables hold it, or free (empty or
    evictable), never both, never lost; every host block is owned by one request or free.
    With KV-cache groups, every group's table counts, holes (NULL_BLOCK) hold nothing, and a
    sliding-window group never holds more than its window's bound."""
    kv = sched.kv
    pool = kv.pool
    owned = [b for tables in kv.tables.values() for table in tables for b in table
             if b != NULL_BLOCK]
    distinct = set(owned)
    assert all(0 <= b < kv.num_blocks for b in owned)
    assert len(owned) == len(distinct) or kv.enable_caching, "a block in two tables"
    for tables in kv.tables.values():
        live = [b for table in tables for b in table if b != NULL_BLOCK]
        assert len(live) == len(set(live)), "a request holds a block twice"
    for b in range(kv.num_blocks):
        assert pool.ref_cnt[b] == owned.count(b), f"block {b}: ref count != holders"
    evictable = {b for b in range(kv.num_blocks) if pool.cache.is_evictable(b)}
    assert not distinct & pool._free, "a referenced block is free"
    assert not distinct & evictable, "a referenced block is evictable"
    assert not pool._free & evictable
    assert all(pool.cache.is_cached(b) for b in evictable)
    assert not any(pool.cache.is_cached(b) for b in pool._free), "an empty block keeps a hash"
    assert len(distinct) + pool.num_free == kv.num_blocks, "blocks leaked"
    stats = kv.stats()
    assert stats.num_used_blocks == len(distinct)
    assert stats.internal_fragmentation >= 0
    if not kv.enable_caching:
        assert len(pool.cache) == 0

    # Tables belong exactly to the running requests, sized for their computed tokens.
    running_ids = {r.request_id for r in sched.running}
    assert set(kv.tables) == running_ids == set(kv.block_tables)
    assert len(sched.running) <= sched.config.max_num_seqs
    chunk = sched.config.max_num_batched_tokens
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert 0 < req.num_computed_tokens <= req.num_tokens
        for g, (table, window) in enumerate(zip(kv.tables[req.request_id], kv.windows)):
            assert len(table) == math.ceil(req.num_computed_tokens / kv.block_size)
            live = [b for b in table if b != NULL_BLOCK]
            assert table[len(table) - len(live):] == live, "a hole after a live block"
            if window is not None:
                assert len(live) <= -(-(window - 1 + chunk) // kv.block_size) + 1
            # A shared block is always a full block of this request's computed tokens, and an
            # indexed block in its table holds exactly the prefix the request expects there.
            for i, b in enumerate(table):
                if b == NULL_BLOCK:
                    continue
                if pool.ref_cnt[b] > 1:
                    assert (i + 1) * kv.block_size <= req.num_computed_tokens
                if pool.cache.is_cached(b):
                    assert pool.cache.lookup(kv._key(g, req.block_hashes[i])) == b
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if not req.swapped_out:
            assert req.num_computed_tokens == 0
    assert running_ids.isdisjoint(r.request_id for r in sched.waiting)

    # Host blocks: only swapped-out waiting requests hold them.
    swap = sched.swap
    host = [b for table in swap.tables.values() for b in table]
    assert len(host) == len(set(host))
    assert set(swap.tables) == {r.request_id for r in sched.waiting if r.swapped_out}
    assert swap.num_used == len(host)
    if swap.pool is not None:
        assert not set(host) & swap.pool._free
        assert len(host) + swap.pool.num_free == swap.pool.num_blocks


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """The batch respects the budget; no-chunk policies run whole prompts only."""
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    ids = [sr.request.request_id for sr in out.scheduled]
    assert len(ids) == len(set(ids))
    assert set(ids).isdisjoint(out.preempted_req_ids)
    for sr in out.scheduled:
        assert sr.num_new_tokens >= 1
        assert len(sr.block_tables) == sched.kv.groups.num_groups
        for table in sr.block_tables:
            assert len(table) * sched.kv.block_size >= sr.start + sr.num_new_tokens
        if not sched.config.chunked:
            assert sr.samples, "a no-chunk policy split a prompt"


class FakeKV:
    """What the runner's KV tensors would hold: per slot, the whole token prefix whose KV it
    is (a token's KV depends on every token before it). Swaps copy it like the runner does.
    Each group's layers write their own blocks and read only their window: a read of a freed
    block (a hole) or of a block another request now holds fails."""

    def __init__(self, sched: Scheduler) -> None:
        self.bs = sched.kv.block_size
        self.windows = sched.kv.windows
        self.device: dict[int, list[tuple[int, ...] | None]] = {}
        self.host: dict[int, list[tuple[int, ...] | None]] = {}

    def run(self, out: SchedulerOutput) -> None:
        for dev, host in out.blocks_to_swap_out:  # out before in, as the runner does
            self.host[host] = list(self.device.get(dev, [None] * self.bs))
        for host, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.host[host])
        for sr in out.scheduled:  # every layer writes the step's K/V before attention reads
            tokens = sr.request.all_token_ids
            for table in sr.block_tables:
                for pos in range(sr.start, sr.start + sr.num_new_tokens):
                    assert table[pos // self.bs] != NULL_BLOCK, "a new token in a hole"
                    block = self.device.setdefault(table[pos // self.bs], [None] * self.bs)
                    block[pos % self.bs] = tuple(tokens[: pos + 1])
        for sr in out.scheduled:
            tokens = sr.request.all_token_ids
            for table, window in zip(sr.block_tables, self.windows):
                # The step's first query reads back to its window's start; later ones less.
                first = 0 if window is None else max(0, sr.start - window + 1)
                for pos in range(first, sr.start + sr.num_new_tokens):
                    assert table[pos // self.bs] != NULL_BLOCK, f"{sr.request} reads a hole"
                    got = self.device[table[pos // self.bs]][pos % self.bs]
                    assert got == tuple(tokens[: pos + 1]), f"{sr.request} reads wrong KV at {pos}"


def fake_step(sched: Scheduler, fake: FakeKV | None = None) -> SchedulerOutput:
    out = sched.schedule()
    check_step(sched, out)
    if fake is not None:
        fake.run(out)
    sched.update_from_output(out, {sr.request.request_id: TOKEN for sr in out.scheduled if sr.samples})
    return out


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_operations_keep_block_accounting_consistent(data: st.DataObject) -> None:
    """Random adds (with shared prefixes), steps, stops, aborts and memory pressure, on every
    policy and preemption mode, prefix caching on or off: reference counts match the tables
    after every operation, no referenced block is ever free, every request reads exactly the KV
    of its own prefix (a fake runner checks each step), and nothing leaks once everything is
    aborted or has run to completion (with its full max_tokens)."""
    random_workload(data, prefix_focus=False)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_shared_prefix_workloads_keep_references_consistent(data: st.DataObject) -> None:
    """The same, with caching on and small blocks, long operation lists and frequent resends
    (multi-turn conversations), so that hits, revivals and evictions happen in most examples."""
    random_workload(data, prefix_focus=True)


def draw_groups(data: st.DataObject, max_model_len: int) -> KVCacheGroups | None:
    """One group (most models), or a full-attention group beside one or two sliding-window
    groups whose window is drawn shorter than the context, so blocks leave it."""
    if not data.draw(st.booleans(), label="sliding_window_groups"):
        return None
    window = data.draw(st.integers(1, max(1, max_model_len - 1)), label="window")
    num_sliding = data.draw(st.integers(1, 2), label="num_sliding_groups")
    windows = (None,) + (window,) * num_sliding
    return KVCacheGroups(windows, tuple((g,) for g in range(len(windows))), 1)


def random_workload(data: st.DataObject, prefix_focus: bool) -> None:
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    mode = data.draw(st.sampled_from(["recompute", "swap"]), label="preemption_mode")
    block_size = data.draw(st.sampled_from([1, 2] if prefix_focus else [1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(6 if prefix_focus else 2, 12), label="num_blocks")
    # The engine refuses a cache smaller than max_model_len, and prompt + max_tokens <= it.
    capacity = num_blocks * block_size
    # Mostly near the cache size, so a few requests are enough to run out of blocks.
    max_model_len = data.draw(
        st.one_of(st.integers(max(2, capacity // 2), capacity), st.integers(2, capacity)),
        label="max_model_len",
    )
    chunked = policy in CHUNKED_SCHEDULERS
    low = 1 if chunked else max_model_len
    budget = data.draw(st.integers(low, 2 * max_model_len), label="budget")
    threshold = data.draw(st.one_of(st.just(0), st.integers(1, max_model_len)), label="threshold")
    config = SchedulerConfig(
        scheduler=policy,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_num_seqs=data.draw(st.sampled_from([1, 2, 4, 256]), label="max_num_seqs"),
        long_prefill_token_threshold=threshold,
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "priority"]), label="sched_policy"),
    )
    num_swap = data.draw(st.integers(0, 2 * num_blocks), label="num_swap_blocks")
    caching = prefix_focus or data.draw(st.booleans(), label="enable_prefix_caching")
    cache_config = CacheConfig(
        block_size=block_size, preemption_mode=mode, enable_prefix_caching=caching
    )
    groups = draw_groups(data, max_model_len)
    if groups is not None:  # the engine's own check: one longest request always fits
        num_blocks = max(num_blocks, groups.blocks_per_token_bound(block_size, max_model_len,
                                                                   budget))
    sched = Scheduler(config.resolve(), cache_config, num_blocks, num_swap, groups)
    fake = FakeKV(sched)
    # Prompts share prefixes: a few fixed "system prompts", cut anywhere, then a short suffix.
    systems = [[100 * (k + 1) + i for i in range(max_model_len)] for k in range(2)]
    expected: dict[str, Request] = {}  # requests that must end by max_tokens
    next_id = 0

    history: list[Request] = []

    def add(prompt_len: int, longest: bool = False, resend: bool = False) -> None:
        nonlocal next_id
        if resend and history:
            # The next turn of a conversation: an earlier request's tokens (prompt and output
            # so far), cut to fit, plus one new token.
            old = history[data.draw(st.integers(0, len(history) - 1), label="resend_of")]
            base = old.all_token_ids[: max_model_len - 2]
            prompt = base + [data.draw(st.integers(10, 12), label="new_token")]
        else:
            system = systems[data.draw(st.integers(0, 1), label="system")]
            shared = data.draw(
                st.one_of(st.just(prompt_len), st.integers(0, prompt_len)), label="shared_len"
            )
            prompt = system[:shared] + data.draw(
                st.lists(st.integers(10, 12), min_size=prompt_len - shared,
                         max_size=prompt_len - shared),
                label="suffix",
            )
        most = max_model_len - len(prompt)
        max_tokens = most if longest else data.draw(st.integers(1, most), label="max_tokens")
        req = Request(
            f"r{next_id}",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0),
            arrival_time=float(next_id),
            eos_token_ids=[EOS],
            priority=data.draw(st.integers(0, 2), label="priority"),
        )
        next_id += 1
        sched.add_request(req)
        expected[req.request_id] = req
        history.append(req)

    def pick_live() -> str | None:
        live = sorted(sched.requests)
        return data.draw(st.sampled_from(live), label="victim") if live else None

    ops = data.draw(
        st.lists(
            st.sampled_from(
                ["add", "add", "resend", "step", "step", "step", "stop", "abort", "abort_mid_step",
                 "pressure"] + ["resend", "resend", "step"] * prefix_focus
            ),
            min_size=10 if prefix_focus else 1,
            max_size=30,
        ),
        label="ops",
    )
    for op in ops:
        if op == "add":
            add(data.draw(st.integers(1, max_model_len - 1), label="prompt_len"))
        elif op == "resend":
            add(1, resend=True)
        elif op == "step":
            fake_step(sched, fake)
        elif op in ("stop", "abort"):
            rid = pick_live()
            if rid is not None:
                status = RequestStatus.FINISHED_STOPPED if op == "stop" else RequestStatus.FINISHED_ABORTED
                sched.finish_requests([rid], status)
                assert expected.pop(rid).status is status
        elif op == "abort_mid_step":
            # Abort between schedule() and update_from_output(): the token is dropped.
            out = sched.schedule()
            check_step(sched, out)
            fake.run(out)  # the runner runs the step whatever is aborted meanwhile
            rid = pick_live()
            if rid is not None:
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                expected.pop(rid)
            sched.update_from_output(
                out, {sr.request.request_id: TOKEN for sr in out.scheduled if sr.samples}
            )
        elif op == "pressure":
            # Short-ish prompts that decode up to max_model_len: admitted while their prompts
            # fit, they then outgrow the pool as they decode, which forces preemptions.
            for _ in range(data.draw(st.integers(2, 4), label="burst")):
                add(data.draw(st.integers(1, max(1, max_model_len // 2)), label="prompt_len"), True)
            for _ in range(data.draw(st.integers(1, 2 * max_model_len), label="pressure_steps")):
                fake_step(sched, fake)
        check_invariants(sched)

    if data.draw(st.booleans(), label="abort_all_at_end"):
        sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
        assert not sched.has_unfinished_requests()
    else:
        idle = 0
        for _ in range(20_000):
            if not sched.has_unfinished_requests():
                break
            out = fake_step(sched, fake)
            check_invariants(sched)
            # A step may be empty after a self-preemption, but never twice in a row.
            idle = 0 if out.scheduled or out.preempted_req_ids else idle + 1
            assert idle < 2, "unfinished requests but nothing scheduled (stuck)"
        assert not sched.has_unfinished_requests(), "requests never finished (livelock?)"
        for req in expected.values():
            assert req.status is RequestStatus.FINISHED_LENGTH
            assert req.num_output_tokens == req.sampling_params.max_tokens
    check_invariants(sched)
    assert sched.kv.pool.num_free == num_blocks and not sched.kv.block_tables
    assert not any(sched.kv.pool.ref_cnt)
    assert sched.swap.num_used == 0 and not sched.swap.tables
    assert not sched.requests
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {sched.kv.prefix_stats.hits > 0}")
    event(f"kv cache groups: {sched.kv.groups.num_groups}")


def test_new_requests_are_placed_with_room_to_grow() -> None:
    """A new request starts a run long enough for its expected size, so growth stays consecutive
    even when several requests grow in turn (the runner then reads views, not copies)."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    for rid in "abc":
        kv.allocate_slots(rid, 8, expected_tokens=32)  # 2 blocks now, room for 8
    for tokens in range(9, 33):
        for rid in "abc":
            kv.allocate_slots(rid, tokens, expected_tokens=32)
    for rid in "abc":
        table = kv.block_tables[rid]
        assert len(table) == 8 and table == list(range(table[0], table[0] + 8))


def test_placement_falls_back_when_no_run_is_long_enough() -> None:
    """Room is a hint: with no long free run the request still gets any free blocks."""
    kv = KVCacheManager(num_blocks=6, block_size=1)
    kv.allocate_slots("a", 1, expected_tokens=1)
    kv.allocate_slots("b", 1, expected_tokens=1)
    kv.allocate_slots("c", 1, expected_tokens=1)
    kv.free("b")
    assert kv.allocate_slots("d", 3, expected_tokens=100) is not None
    assert kv.stats().num_free_blocks == 1


@settings(max_examples=200, deadline=None)
@given(
    used=st.sets(st.integers(0, 47)),
    length=st.integers(1, 12),
    cursor=st.integers(0, 47),
)
def test_find_run_matches_a_plain_scan(used: set[int], length: int, cursor: int) -> None:
    """The skipping search returns the first run a block-by-block scan finds: from the cursor
    on, then from 0."""
    pool = BlockPool(48)
    pool._free -= used
    pool._cursor = cursor

    def plain(lo: int) -> int | None:
        run = 0
        for block in range(lo, 48):
            run = run + 1 if block not in used else 0
            if run == length:
                return block - length + 1
        return None

    expected = plain(cursor)
    assert pool._find_run(length) == (plain(0) if expected is None else expected)


def test_fragmentation_stat_follows_allocations_and_frees() -> None:
    """stats() keeps running totals; they must equal a walk over the tables."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 9)
    kv.allocate_slots("a", 6)
    assert kv.stats().internal_fragmentation == (2 + 3) * 4 - (6 + 9)
    kv.free("a")
    assert kv.stats().internal_fragmentation == 3 * 4 - 9
    kv.free("b")
    assert kv.stats().internal_fragmentation == 0
