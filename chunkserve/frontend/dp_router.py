"""Which engine a request goes to under `--data-parallel-size N` (issue 30): the routing rule.

Pure bookkeeping, no processes: the API server asks `route(prompt_token_ids)` for an engine
index, and feeds engine load reports back through `update`.

The rule:

1. Load. Each engine's score is `waiting * 4 + running` (vLLM's DP load balancing): a waiting
   request has not even started prefill, so it delays everything behind it far more than one
   more sequence in a decode batch does.
2. Prefix affinity first. The request's first `affinity_blocks` full KV blocks are hashed with
   the engine's own chained block hash, so the router's keys are the prefix cache's keys. Each
   engine remembers the hashes of the prefixes recently routed to it; the engine holding the
   longest matching prefix gets the request (ties: the lower score, then the lower index),
   unless it is overloaded: its score exceeds the lowest score of all engines by more than
   `overload_margin`. Then the next-longest match that is not overloaded is tried, and
   finally plain load. A prompt shorter than one block has no affinity.
3. Plain load: the lowest score wins; ties go to the lowest engine index. The local increment
   (below) already rotates a burst through equally loaded engines, so round-robin state among
   ties would add nothing but nondeterminism to tests and simulations.

Between reports the router keeps its own view: routing to engine i counts one more waiting
request there, so a burst arriving between two reports spreads out instead of all landing on
the engine that looked idlest. `update` replaces the view with the engine's own counts, which
already include (or no longer include) the requests routed since, so no `finished`/`aborted`
calls are needed: any drift lasts at most until the next report.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from chunkserve.core.block_hash import BlockHash, extend_block_hashes

WAITING_WEIGHT = 4
# Two queued requests' worth of score: affinity may send a request to an engine that is up to
# two waiting requests (or eight running sequences) busier than the idlest one. A cache hit
# saves a prefill of the shared prefix (system prompts run to thousands of tokens, far past the
# K hashed blocks), worth a short queue; more than that and the wait costs more than the hit.
# It also bounds a hot prefix's burst: once its engine is `margin` ahead, the prefix spills to
# a second engine, which then remembers it too.
DEFAULT_OVERLOAD_MARGIN = 2 * WAITING_WEIGHT
# Hashes remembered per engine. With 4 hashes per request that is the prefixes of the last
# ~1024 distinct requests; at 32-byte digests plus OrderedDict overhead, ~0.5 MB per engine.
# The engine's real cache may evict sooner: a stale entry only costs a cache miss.
DEFAULT_CACHE_SIZE = 4096


def _check_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; `True` engines is a caller bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class DPRouter:
    """Picks an engine per request from prefix affinity and reported load (module docstring)."""

    def __init__(
        self,
        num_engines: int,
        block_size: int = 16,
        affinity_blocks: int = 4,
        overload_margin: int = DEFAULT_OVERLOAD_MARGIN,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.num_engines = _check_int("num_engines", num_engines, 1)
        self.block_size = _check_int("block_size", block_size, 1)
        # 0 turns affinity off: pure load balancing.
        self.affinity_blocks = _check_int("affinity_blocks", affinity_blocks, 0)
        self.overload_margin = _check_int("overload_margin", overload_margin, 0)
        self.cache_size = _check_int("cache_size", cache_size, 1)
        self._waiting = [0] * num_engines
        self._running = [0] * num_engines
        # Per engine: recently routed prefix hashes, oldest first (an LRU set).
        self._recent: list[OrderedDict[BlockHash, None]] = [
            OrderedDict() for _ in range(num_engines)
        ]

    def load(self, engine: int) -> int:
        """The engine's score in the router's current view: waiting * 4 + running."""
        self._check_engine(engine)
        return self._waiting[engine] * WAITING_WEIGHT + self._running[engine]

    def update(self, engine: int, waiting: int, running: int) -> None:
        """An engine's load report: replaces the router's view of that engine."""
        self._check_engine(engine)
        self._waiting[engine] = _check_int("waiting", waiting, 0)
        self._running[engine] = _check_int("running", running, 0)

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """The engine for this request; counts it as waiting there and remembers its prefix."""
        hashes = extend_block_hashes([], prompt_token_ids, self.block_size, self.affinity_blocks)
        engine = self._pick_by_affinity(hashes)
        if engine is None:
            # min() keeps the first of equal keys: ties go to the lowest index.
            engine = min(range(self.num_engines), key=self.load)
        self._waiting[engine] += 1
        self._remember(engine, hashes)
        return engine

    def _pick_by_affinity(self, hashes: list[BlockHash]) -> int | None:
        """The engine with the longest matching prefix that is not overloaded, if any."""
        if not hashes:
            return None
        threshold = min(self.load(e) for e in range(self.num_engines)) + self.overload_margin
        by_length: dict[int, list[int]] = {}
        for engine in range(self.num_engines):
            matched = self._matched_blocks(engine, hashes)
            if matched and self.load(engine) <= threshold:
                by_length.setdefault(matched, []).append(engine)
        if not by_length:
            return None
        return min(by_length[max(by_length)], key=self.load)

    def _matched_blocks(self, engine: int, hashes: list[BlockHash]) -> int:
        # Hashes chain their parents, so a match on block j means blocks 0..j all match:
        # the longest match is the last hash the engine remembers.
        recent = self._recent[engine]
        for length in range(len(hashes), 0, -1):
            if hashes[length - 1] in recent:
                return length
        return 0

    def _remember(self, engine: int, hashes: list[BlockHash]) -> None:
        recent = self._recent[engine]
        for h in hashes:  # shortest prefix first, so the longest is the freshest
            recent[h] = None
            recent.move_to_end(h)
        while len(recent) > self.cache_size:
            recent.popitem(last=False)

    def _check_engine(self, engine: int) -> None:
        valid = isinstance(engine, int) and not isinstance(engine, bool)
        if not valid or not 0 <= engine < self.num_engines:
            raise ValueError(f"engine must be in [0, {self.num_engines}), got {engine!r}")
