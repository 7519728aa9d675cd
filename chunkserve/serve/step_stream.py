"""The live step stream behind the web page's engine view (GET /engine/steps).

Every engine step's record already reaches the server (AsyncEngine._handle, where the metrics
observe it); `StepStream.observe` is called at that same point. A person watching a page needs
at most ~20 pictures a second, while the engine may step a thousand times a second, so the
records are decimated: `StepWindow` folds the records of each 50 ms window into one summary,
one window per engine (`--data-parallel-size`).

The request lanes are drawn from here too: each window runs its engine's records through
engine/lanes.py, the rule the Perfetto timeline uses, and its summaries carry the spans that
closed, the instants, and the spans still open; the page only draws them.

Nobody watching costs one attribute check a step: `observe` returns at once while there is no
subscriber, and each subscriber's records are summarized (lanes included) on the event loop,
not the engine's thread.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

from chunkserve.engine.lanes import LaneEvent, Lanes, LaneSpan
from chunkserve.engine.engine_loop import LoopEvent
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


def lane_json(e: LaneEvent) -> dict[str, Any]:
    """A lane span or instant as the page gets it: times on the engine clock, as the steps'."""
    out: dict[str, Any] = {"kind": e.kind, "request_id": e.request_id, "slot": e.slot}
    if isinstance(e, LaneSpan):
        out["start"] = e.start
        if e.end is not None:  # an open span has none: the page draws it up to "now"
            out["end"] = e.end
    else:
        out["at"] = e.at
    if e.args:
        out["args"] = e.args
    return out


class StepWindow:
    """Decimation for one engine: records in, at most one summary per `interval` seconds out,
    with that engine's request lanes. Pure (the caller gives the time), so tests drive it with
    made-up clocks."""

    def __init__(self, interval: float = INTERVAL_S, engine: int = 0) -> None:
        self.interval = interval
        self.engine = engine
        # A page opens mid-run: requests already running are adopted at their next chunk.
        self._lanes = Lanes(adopt=True)
        self._steps: list[dict[str, Any]] = []
        self._spans: list[dict[str, Any]] = []
        self._instants: list[dict[str, Any]] = []
        self._latest: StepRecord | None = None
        self._last_emit: float | None = None

    def add(self, record: StepRecord) -> None:
        self._steps.append(step_summary(record, self.engine))
        for e in self._lanes.add(record):
            (self._spans if isinstance(e, LaneSpan) else self._instants).append(lane_json(e))
        self._latest = record

    def wait(self, now: float) -> float:
        """Seconds until a summary may be taken (0 when one may be taken now)."""
        if self._last_emit is None:
            return 0.0
        return max(0.0, self._last_emit + self.interval - now)

    def take(self, now: float) -> Summary | None:
        """The window's summary, if it has steps and its interval has passed; None otherwise
        (the steps stay for the next window). `spans`: those closed in the window; `open`: the
        spans open at its last step, each request's current one."""
        if not self._steps or self.wait(now) > 0:
            return None
        record = self._latest
        assert record is not None
        summary = {"steps": self._steps, "kv_usage": record.kv_usage,
                   "waiting": record.num_waiting, "running": record.num_running,
                   "engine": self.engine, "spans": self._spans, "instants": self._instants,
                   "open": [lane_json(span) for span in self._lanes.open_spans()]}
        self._steps, self._spans, self._instants = [], [], []
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

    def on_event(self, index: int, ev: LoopEvent) -> None:
        """An engine loop's event (frontend/async_engine.py's observers), on any thread."""
        if ev.record is not None:
            self.observe(ev.record, index)

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
        windows: dict[int, StepWindow] = {}  # by engine: each has its own lanes and slots
        loop = asyncio.get_running_loop()
        try:
            while True:
                while q:
                    record, engine = q.popleft()
                    window = windows.get(engine)
                    if window is None:
                        window = windows[engine] = StepWindow(self.interval, engine)
                    window.add(record)
                for engine in sorted(windows):
                    summary = windows[engine].take(loop.time())
                    if summary is not None:
                        yield summary
                await asyncio.sleep(self.interval)
        finally:
            self._queues = tuple(x for x in self._queues if x is not q)
