"""The live step stream behind the web page's engine view (GET /engine/steps).

Every engine step's record already reaches the server (AsyncEngine._handle, where the metrics
observe it); `StepStream.observe` is called at that same point. A person watching a page needs
at most ~20 pictures a second, while the engine may step a thousand times a second, so the
records are decimated: `StepWindow` folds the records of each 50 ms window into one summary.

Nobody watching costs one attribute check a step: `observe` returns at once while there is no
subscriber, and each subscriber's records are summarized on the event loop, not the engine's
thread.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

from chunkserve.engine.trace import StepRecord

INTERVAL_S = 0.05  # 20 summaries a second at most
# A subscriber that stops reading keeps at most this many records (the oldest are dropped):
# ~10 s of steps at 1,000 steps a second.
MAX_PENDING = 10_000
# The request events a record carries, by the name the summary gives them: the step records'
# per-request lists (docs/trace.md), which the timeline export reads too.
RECORD_EVENTS = {"arrived": "arrived_requests", "admitted": "admitted_requests",
                "chunks": "prefill_requests", "sampled": "sampled_prefills",
                "preempted": "preempted_requests", "finished": "finished_requests"}
Summary = dict[str, Any]


def step_summary(record: StepRecord, engine: int) -> dict[str, Any]:
    """One step as the page draws it: its time, its token split and budget, and the request
    events of the step (only those that happened, to keep the stream small)."""
    step: dict[str, Any] = {
        "step": record.step, "engine": engine, "start": record.start,
        "duration": record.duration, "prefill_tokens": record.num_prefill_tokens,
        "decode_tokens": record.num_decode_tokens, "budget": record.token_budget,
        "preemptions": record.num_preemptions}
    for name, field in RECORD_EVENTS.items():
        events = getattr(record, field)
        if events:
            step[name] = events
    return step


class StepWindow:
    """Decimation: records in, at most one summary per `interval` seconds out. Pure (the caller
    gives the time), so tests drive it with made-up clocks."""

    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.interval = interval
        self._steps: list[dict[str, Any]] = []
        self._latest: tuple[StepRecord, int] | None = None
        self._last_emit: float | None = None

    def add(self, record: StepRecord, engine: int = 0) -> None:
        self._steps.append(step_summary(record, engine))
        self._latest = (record, engine)

    def wait(self, now: float) -> float:
        """Seconds until a summary may be taken (0 when one may be taken now)."""
        if self._last_emit is None:
            return 0.0
        return max(0.0, self._last_emit + self.interval - now)

    def take(self, now: float) -> Summary | None:
        """The window's summary, if it has steps and its interval has passed; None otherwise
        (the steps stay for the next window)."""
        if not self._steps or self.wait(now) > 0:
            return None
        assert self._latest is not None
        record, engine = self._latest
        summary = {"steps": self._steps, "kv_usage": record.kv_usage,
                   "waiting": record.num_waiting, "running": record.num_running,
                   "engine": engine}
        self._steps = []
        self._last_emit = now
        return summary


class StepStream:
    """The subscribers of the step stream, each with its own queue of records."""

    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.interval = interval
        # Replaced, never mutated, so the engine's thread iterates a consistent tuple.
        self._queues: tuple[collections.deque[tuple[StepRecord, int]], ...] = ()

    @property
    def subscribers(self) -> int:
        return len(self._queues)

    def observe(self, record: StepRecord, engine: int = 0) -> None:
        """Any thread (an engine's loop): the record goes to every subscriber's queue."""
        queues = self._queues
        if not queues:
            return
        for q in queues:
            q.append((record, engine))  # deque.append is atomic: no lock on the step's path

    async def summaries(self) -> AsyncIterator[Summary]:
        """Summaries from now on, until the consumer stops iterating (a disconnect)."""
        q: collections.deque[tuple[StepRecord, int]] = collections.deque(maxlen=MAX_PENDING)
        self._queues = (*self._queues, q)
        window = StepWindow(self.interval)
        loop = asyncio.get_running_loop()
        try:
            while True:
                while q:
                    window.add(*q.popleft())
                summary = window.take(loop.time())
                if summary is not None:
                    yield summary
                await asyncio.sleep(self.interval)
        finally:
            self._queues = tuple(x for x in self._queues if x is not q)
