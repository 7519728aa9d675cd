"""The data-parallel routing rule (chunkserve/frontend/dp_router.py): load score, local
increments, prefix affinity and its overload escape, the LRU bound, argument checks."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve.frontend.dp_router import DEFAULT_OVERLOAD_MARGIN, DPRouter

BLOCK = 16


def _prompt(seed: int, blocks: int, extra: int = 0) -> list[int]:
    """A prompt of `blocks` full blocks (plus `extra` tokens) unique to `seed`."""
    return [seed * 100_000 + i for i in range(blocks * BLOCK + extra)]


def test_lowest_score_wins_and_waiting_weighs_four_times_running() -> None:
    router = DPRouter(2, affinity_blocks=0)
    router.update(0, waiting=1, running=0)  # score 4
    router.update(1, waiting=0, running=3)  # score 3
    assert (router.load(0), router.load(1)) == (4, 3)
    assert router.route(_prompt(1, 1)) == 1
    router.update(0, waiting=1, running=0)
    router.update(1, waiting=0, running=5)  # score 5: one waiting is worth only four running
    assert router.route(_prompt(2, 1)) == 0


def test_ties_go_to_the_lowest_index_and_a_burst_rotates() -> None:
    router = DPRouter(3)
    picks = [router.route(_prompt(seed, 2)) for seed in range(9)]
    # Each pick counts one waiting request locally, so the next pick moves on.
    assert picks == [0, 1, 2] * 3
    assert [router.load(e) for e in range(3)] == [12, 12, 12]


def test_update_replaces_the_local_view() -> None:
    router = DPRouter(2)
    router.route(_prompt(1, 0, extra=3))
    assert router.load(0) == 4
    router.update(0, waiting=0, running=2)
    assert router.load(0) == 2


def test_affinity_sends_a_shared_prefix_back_to_its_engine() -> None:
    router = DPRouter(2)
    system = _prompt(7, 4)
    assert router.route(system + [1, 2, 3]) == 0
    # Engine 1 is idler (0 vs 4) but within the margin: the cached prefix wins.
    assert router.route(system + [9, 9]) == 0
    # A different prompt has no affinity and takes the idler engine.
    assert router.route(_prompt(8, 4)) == 1


def test_affinity_yields_when_its_engine_is_overloaded() -> None:
    router = DPRouter(2)
    system = _prompt(7, 4)
    assert router.route(system) == 0
    router.update(0, waiting=0, running=DEFAULT_OVERLOAD_MARGIN)  # exactly at the margin
    assert router.route(system + [1]) == 0
    router.update(0, waiting=0, running=DEFAULT_OVERLOAD_MARGIN + 1)  # past it
    assert router.route(system + [2]) == 1


def test_a_hot_prefix_spills_to_a_second_engine_then_shares_it() -> None:
    router = DPRouter(2, overload_margin=4)
    system = _prompt(3, 2)
    picks = [router.route(system + [i]) for i in range(6)]
    # Engine 0 takes requests until it is more than 4 ahead, then engine 1 (now remembering
    # the prefix too) shares the burst by load.
    assert picks == [0, 0, 1, 1, 0, 1]


def test_the_longest_matching_prefix_wins_over_load() -> None:
    router = DPRouter(3)
    a = _prompt(1, 2)
    assert router.route(a) == 0  # engine 0 remembers a[:16], a[:32]
    # Same first block, different second block; forced onto engine 1 by overloading 0.
    b = a[:BLOCK] + _prompt(2, 1)
    router.update(0, waiting=5, running=0)
    assert router.route(b) == 1  # engine 1 remembers b[:16] (== a[:16]), b[:32]
    router.update(0, waiting=0, running=0)
    router.update(1, waiting=1, running=0)  # busier than engine 0, within the margin
    assert router.route(b + _prompt(3, 1)) == 1  # 2 matching blocks beat 1
    router.update(1, waiting=0, running=0)
    router.update(0, waiting=0, running=1)
    # Equal match lengths (one block each): the lower load wins.
    assert router.route(a[:BLOCK] + _prompt(4, 1)) == 1


def test_a_prompt_shorter_than_one_block_has_no_affinity() -> None:
    router = DPRouter(2)
    short = list(range(BLOCK - 1))
    assert router.route(short) == 0
    assert router.route(short) == 1  # by load alone
    one_block = list(range(BLOCK))
    router.update(0, 0, 0)
    router.update(1, 0, 0)
    assert router.route(one_block) == 0
    assert router.route(one_block) == 0  # one full block is enough for affinity
    assert router.route([]) == 1


def test_the_lru_bound_holds_and_evicts_the_oldest() -> None:
    router = DPRouter(2, affinity_blocks=1, cache_size=2)
    router.update(1, waiting=100, running=0)  # keep everything on engine 0
    prompts = [_prompt(seed, 1) for seed in range(3)]
    for p in prompts:
        assert router.route(p) == 0
    assert len(router._recent[0]) == 2  # the bound, not 3
    router.update(0, waiting=1, running=0)
    router.update(1, waiting=0, running=0)
    assert router.route(prompts[2]) == 0  # still remembered
    assert router.route(prompts[0]) == 1  # evicted: routed by load
    for seed in range(50):
        router.route(_prompt(100 + seed, 1))
    assert all(len(recent) <= 2 for recent in router._recent)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_engines": 0},
        {"num_engines": -1},
        {"num_engines": 1.5},
        {"num_engines": True},
        {"num_engines": 2, "block_size": 0},
        {"num_engines": 2, "affinity_blocks": -1},
        {"num_engines": 2, "overload_margin": -1},
        {"num_engines": 2, "cache_size": 0},
    ],
)
def test_bad_constructor_arguments_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        DPRouter(**kwargs)  # type: ignore[arg-type]


def test_bad_engine_and_load_arguments_raise() -> None:
    router = DPRouter(2)
    for engine in (-1, 2, "0", None):
        with pytest.raises(ValueError, match="engine"):
            router.load(engine)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="engine"):
            router.update(engine, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="waiting"):
        router.update(0, -1, 0)
    with pytest.raises(ValueError, match="running"):
        router.update(0, 0, -3)


@settings(max_examples=200, deadline=None)
@given(
    num_engines=st.integers(1, 8),
    prompts=st.lists(st.lists(st.integers(0, 50), max_size=40), max_size=60),
)
def test_without_affinity_equal_engines_stay_within_one(
    num_engines: int, prompts: list[list[int]]
) -> None:
    router = DPRouter(num_engines, affinity_blocks=0)
    counts = [0] * num_engines
    for p in prompts:
        counts[router.route(p)] += 1
    assert max(counts) - min(counts) <= 1


# ---- the router inside the server's front end (frontend/async_engine.py) ----------------------------


class _Client:
    """An engine client that records commands; the test plays its loop's events."""

    def __init__(self, index: int) -> None:
        from types import SimpleNamespace

        self.index = index
        self.info = SimpleNamespace(block_size=BLOCK, processor=None)
        self.sent: list[object] = []

    def start(self, handle) -> None:  # type: ignore[no-untyped-def]
        self.handle = handle

    def send(self, command: object) -> None:
        self.sent.append(command)

    def is_alive(self) -> bool:
        return True

    def shutdown(self, timeout: float) -> None:
        pass


def test_the_front_end_routes_adds_and_sends_aborts_to_the_same_engine() -> None:
    import asyncio

    from chunkserve.engine.llm_engine import EngineStats
    from chunkserve.engine.processor import EngineRequest
    from chunkserve.sampling_params import SamplingParams
    from chunkserve.frontend.async_engine import AsyncEngine
    from chunkserve.engine.engine_loop import Abort, Add, LoopEvent

    def request(rid: str, prompt: list[int]) -> EngineRequest:
        return EngineRequest(rid, None, prompt, SamplingParams(max_tokens=4), [])

    async def main() -> None:
        clients = [_Client(0), _Client(1)]
        ae = AsyncEngine(clients)  # type: ignore[arg-type]
        ae.start()
        system = _prompt(7, 4)
        streams = {rid: ae.generate(request(rid, prompt)) for rid, prompt in
                   (("a", system + [1]), ("b", system + [2]), ("c", _prompt(8, 4)))}
        tasks = {rid: asyncio.ensure_future(s.__anext__()) for rid, s in streams.items()}
        await asyncio.sleep(0.01)
        routed = {c.index: [cmd.request.request_id for cmd in c.sent if isinstance(cmd, Add)]
                  for c in clients}
        # "b" shares "a"'s prefix: same engine; "c" has none and takes the idle one.
        assert routed == {0: ["a", "b"], 1: ["c"]}
        assert ae.num_queued == 3
        # Engine 1's loop applied "c" and runs it: its queue empties, the router learns it.
        stats = EngineStats(num_running=1, num_waiting=0, kv_usage=0.1,
                            kv_internal_fragmentation=0)
        clients[1].handle(1, LoopEvent(num_applied=1, stats=stats))
        await asyncio.sleep(0.01)
        assert ae.num_queued == 2 and ae.router is not None and ae.router.load(1) == 1
        tasks["c"].cancel()  # the client went away: the abort goes to "c"'s engine
        await asyncio.sleep(0.01)
        await streams["c"].aclose()
        assert [cmd for cmd in clients[1].sent if isinstance(cmd, Abort)] == [Abort("c")]
        assert not any(isinstance(cmd, Abort) for cmd in clients[0].sent)
        for rid in ("a", "b"):
            tasks[rid].cancel()
        await asyncio.sleep(0.01)
        assert [cmd for cmd in clients[0].sent if isinstance(cmd, Abort)] == [Abort("a"),
                                                                              Abort("b")]

    asyncio.run(main())
