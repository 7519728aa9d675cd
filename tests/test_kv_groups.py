"""KV-cache groups for sliding-window layers (core/kv_groups.py, core/prefix_hit.py and the
manager's tables): grouping, the window's block bound during a long chunked prefill, prefix
hits that end at the same token in every group, and the memory the windows give back. Pure
Python; tests/test_kv_cache.py's property test runs random workloads on groups too."""
from __future__ import annotations

import pytest

from chunkserve.config import CacheConfig, SchedulerConfig
from chunkserve.core.kv_cache import NULL_BLOCK, KVCacheManager
from chunkserve.core.kv_groups import KVCacheGroups, group_layers, single_group
from chunkserve.core.prefix_hit import find_hit, first_needed_block
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.scheduler import Scheduler
from chunkserve.sampling_params import SamplingParams

BS = 4
WINDOW = 8
# One full-attention layer and one sliding-window layer, one group each.
TWO = KVCacheGroups((None, WINDOW), ((0,), (1,)), 1)


def _req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0),
                   arrival_time=0.0)


def _live(table: list[int]) -> int:
    return sum(b != NULL_BLOCK for b in table)


# ---- grouping --------------------------------------------------------------------------------
def test_gemma3_270m_layers_make_groups_of_three() -> None:
    """18 layers, every 6th global: 3 full, 15 sliding -> one full group and five sliding ones
    of three layers each; a block id is then three layers' K/V."""
    windows = [None if i % 6 == 5 else 512 for i in range(18)]
    groups = group_layers(windows)
    assert groups.group_size == 3
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11, 17)
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    slots = groups.slot_of_layer()
    assert sorted(slots) == list(range(18)) and slots[11] == (0, 1)


def test_uniform_layers_are_one_group() -> None:
    assert group_layers([None] * 4) == single_group(4)
    assert group_layers([64] * 4).windows == (64,)
    with pytest.raises(ValueError, match="sliding window must be positive"):
        group_layers([None, 0])


def test_bound_counts_a_window_group_by_its_window() -> None:
    # 100 tokens, chunks of 6: full 25 blocks; sliding ceil((8 - 1 + 6) / 4) + 1 = 5.
    assert TWO.blocks_per_token_bound(BS, 100, 6) == 25 + 5
    assert TWO.blocks_per_token_bound(BS, 6, 6) == 2 + 3  # never more than the tokens + 1


def test_the_longest_request_a_pool_holds_is_the_bounds_inverse() -> None:
    # The engine's hint when max_model_len does not fit (vLLM's "estimated maximum model length").
    for blocks in (0, 4, 5, 30, 31, 200):
        fits = TWO.max_tokens_within(BS, blocks, 6, upper=10_000)
        assert fits == 0 or TWO.blocks_per_token_bound(BS, fits, 6) <= blocks
        assert TWO.blocks_per_token_bound(BS, fits + 1, 6) > blocks
    assert TWO.max_tokens_within(BS, 10_000, 6, upper=100) == 100  # never past `upper`


# ---- the window frees blocks as the request advances -----------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 8, 13])
def test_long_chunked_prefill_keeps_the_window_group_bounded(chunk: int) -> None:
    """Between chunks of one prompt the sliding group gives back what left the window: it
    never holds more than ceil((W - 1 + chunk) / block_size) + 1 blocks, the full group all."""
    kv = KVCacheManager(64, BS, enable_caching=False, groups=TWO)
    bound = -(-(WINDOW - 1 + chunk) // BS) + 1
    done, total = 0, 25 * BS
    while done < total:
        n = min(chunk, total - done)
        assert kv.allocate_slots("a", done + n, num_computed=done) is not None
        full, sliding = kv.tables["a"]
        assert len(full) == len(sliding) == -(-(done + n) // BS) == _live(full)
        assert _live(sliding) <= bound
        # Exactly the blocks of positions done - W + 1 onwards stay: what queries still read.
        assert sliding.index(next(b for b in sliding if b != NULL_BLOCK)) == \
            first_needed_block(WINDOW, done, BS)
        done += n
    assert kv.pool.num_free == 64 - 25 - _live(kv.tables["a"][1])
    kv.free("a")
    assert kv.pool.num_free == 64


def test_more_requests_fit_with_window_groups() -> None:
    """One full and three sliding layers in the same memory: 160 one-layer blocks as groups
    of one layer, or 40 blocks of all four layers as one group. Requests of 64 tokens (chunks
    of 8) hold 16 blocks as one group: 2 fit; as groups, 16 + 3 * 4 at most: 5 fit."""
    wide = KVCacheGroups((None, WINDOW, WINDOW, WINDOW), ((0,), (1,), (2,), (3,)), 1)
    assert _fits(single_group(4), 40) == 2
    assert _fits(wide, 160) == 5


def _fits(groups: KVCacheGroups, num_blocks: int) -> int:
    """How many 64-token requests, prefilled one after another, the pool holds at once."""
    kv = KVCacheManager(num_blocks, BS, enable_caching=False, groups=groups)
    n = 0
    while True:
        for done in range(0, 64, 8):
            if kv.allocate_slots(f"r{n}", done + 8, num_computed=done) is None:
                return n
        n += 1


# ---- prefix caching per group -----------------------------------------------------------------
def _prefill(kv: KVCacheManager, req: Request, chunk: int) -> None:
    done = 0
    hit = kv.get_computed_blocks(req)
    if hit:
        done = hit.num_blocks * BS
    first = True
    while done < req.num_tokens:
        n = min(chunk, req.num_tokens - done)
        assert kv.allocate_slots(req.request_id, done + n, computed_blocks=hit if first else None,
                                 num_computed=done) is not None
        first = False
        kv.cache_blocks(req, done + n)
        done += n


def test_a_hit_ends_at_the_same_token_in_every_group() -> None:
    """A 40-token prompt prefilled in chunks, its sliding blocks freed (evictable, still
    cached). A second prompt sharing 33 tokens hits 8 blocks in both groups: the full group
    takes all eight, the sliding group only the blocks of the last W - 1 tokens."""
    kv = KVCacheManager(64, BS, groups=TWO)
    tokens = list(range(100, 140))
    _prefill(kv, _req("a", tokens), chunk=4)
    b = _req("b", tokens[:33] + [7, 7, 7])
    hit = kv.get_computed_blocks(b)
    assert hit.num_blocks == 8
    full, sliding = hit.tables
    assert full == kv.tables["a"][0][:8]
    first = first_needed_block(WINDOW, 8 * BS, BS)  # positions 25.. -> block 6
    assert sliding[:first] == [NULL_BLOCK] * first
    # Block 6 already left a's window (freed, evictable, still cached): the hit revives it.
    assert kv.tables["a"][1][first] == NULL_BLOCK and NULL_BLOCK not in sliding[first:]
    assert sliding[first + 1:] == kv.tables["a"][1][first + 1:8]
    kv.free("a")
    _prefill(kv, b, chunk=4)
    assert kv.tables["b"][0][:8] == full and kv.tables["b"][1][first:8] == sliding[first:]


def test_a_hit_shortens_until_every_group_has_its_window() -> None:
    """When the sliding group's blocks near the end of the shared prefix are gone (evicted),
    the hit is cut back to where that group still has a whole window cached."""
    # A fake cache: the full group has blocks 0..9; the sliding group has 0..5 and 8..9.
    full = {i: 100 + i for i in range(10)}
    sliding = {i: 200 + i for i in (0, 1, 2, 3, 4, 5, 8, 9)}

    def lookup(g: int, i: int) -> int | None:
        return (full if g == 0 else sliding).get(i)

    hit = find_hit(lookup, (None, WINDOW), BS, 10)
    # A hit of 10 blocks needs sliding blocks 8, 9 (positions 33..39) -> cached: 10 holds.
    assert hit.num_blocks == 10 and hit.tables[1] == [NULL_BLOCK] * 8 + [208, 209]
    del sliding[9]
    hit = find_hit(lookup, (None, WINDOW), BS, 10)
    # 9 blocks needs blocks 7, 8 (positions 29..35): 7 is gone; 8 needs 6, 7: gone; 7 needs
    # 5, 6: gone; 6 needs 4, 5: cached.
    assert hit.num_blocks == 6 and hit.tables[1] == [NULL_BLOCK] * 4 + [204, 205]
    assert hit.tables[0] == [100 + i for i in range(6)]
    del full[3]
    assert find_hit(lookup, (None, WINDOW), BS, 10).num_blocks == 3


# ---- the scheduler: preemption and aborts release every group --------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_aborts_release_every_group(mode: str) -> None:
    config = SchedulerConfig(max_num_batched_tokens=8, max_model_len=64).resolve()
    blocks = TWO.blocks_per_token_bound(BS, 64, 8)
    sched = Scheduler(config, CacheConfig(block_size=BS, preemption_mode=mode), blocks + 4,
                      num_swap_blocks=64, kv_cache_groups=TWO)
    reqs = [_req(f"r{i}", [10 + i] * 30, max_tokens=30) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 5 for s in out.scheduled
                                       if s.samples})
        if sched.num_preemptions and reqs[0].status is RequestStatus.RUNNING:
            sched.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.num_preemptions > 0
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free == blocks + 4 and not sched.kv.tables
    assert sched.swap.num_used == 0
