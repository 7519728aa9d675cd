"""Request lanes: which slot each request holds and what it is doing, from the step records'
request events (engine/trace.py). The one implementation of the rule, shared by the Perfetto
timeline (engine/timeline.py) and the web page's live step stream (serve/step_stream.py), so
the page and a trace file draw the same lanes.

The rule: a request holds the lowest free slot from its arrival to its end (so a thousand
requests stay readable), and its lane shows it waiting, each prefill chunk, and decoding, with
instants for its first token and for a preemption. Times are the engine clock's seconds.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from chunkserve.engine.trace import StepRecord


@dataclass(frozen=True)
class LaneSpan:
    kind: str  # "waiting", "prefill" (one chunk) or "decode"
    request_id: str
    slot: int
    start: float
    end: float | None  # None: still open (`Lanes.open_spans`)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaneInstant:
    kind: str  # "first token" or "preempted"
    request_id: str
    slot: int
    at: float
    args: dict[str, Any] = field(default_factory=dict)


LaneEvent = LaneSpan | LaneInstant


@dataclass
class _Request:
    slot: int
    phase: str  # "waiting", "running" (admitted: between chunks) or "decode"
    since: float  # when the open span began
    arrival: float | None  # None: adopted mid-run (`Lanes(adopt=True)`), arrival unseen
    prompt_tokens: int
    chunks: int = 0
    first_token: float | None = None


class Lanes:
    """Lane events from step records, given one at a time, in step order.

    `adopt`: a watcher that starts mid-run (a web page opened while requests run) has not seen
    the earlier requests arrive; with it, a request first seen in a prefill chunk takes a slot
    there. A trace is read from its first step, so the timeline leaves it off."""

    def __init__(self, adopt: bool = False) -> None:
        self.adopt = adopt
        self._requests: dict[str, _Request] = {}
        self._free: list[int] = []  # freed slots, lowest first
        self.num_slots = 0  # slots ever used: the lanes to draw

    def add(self, rec: StepRecord) -> list[LaneEvent]:
        """The spans this step closes (each chunk is one) and its instants, in order."""
        start, end = rec.start, rec.start + rec.duration
        events: list[LaneEvent] = []
        for rid, arrival, prompt_tokens in rec.arrived_requests:
            self._arrive(rid, arrival, prompt_tokens)
        for rid in rec.preempted_requests:
            self._preempt(rid, start, events)
        for rid in rec.admitted_requests:
            self._leave_queue(rid, start, events)
        chunked = set()
        for rid, tokens, cached in rec.prefill_requests:
            chunked.add(rid)
            self._chunk(rid, tokens, cached, start, end, events)
        for rid in rec.admitted_requests:  # swapped back in: it decodes at once
            r = self._requests.get(rid)
            if r is not None and rid not in chunked and r.first_token is not None:
                r.phase, r.since = "decode", start
        for rid in rec.sampled_prefills:
            self._first_token_or_resume(rid, end, events)
        for rid in rec.finished_requests:
            if rid in self._requests:
                self._close(rid, end, events)
                self._release(rid)
        return events

    def open_spans(self) -> list[LaneSpan]:
        """The spans open now (waiting, decoding), without an end: what a live view extends."""
        return [LaneSpan(r.phase, rid, r.slot, r.since, None, self._span_args(r))
                for rid, r in self._requests.items() if r.phase != "running"]

    def finish(self, at: float) -> list[LaneSpan]:
        """Spans still open (a run stopped mid-way), closed at `at` and marked so."""
        events: list[LaneEvent] = []
        for rid in list(self._requests):
            self._close(rid, at, events, open_at_end=True)
            self._release(rid)
        return [e for e in events if isinstance(e, LaneSpan)]

    def _arrive(self, rid: str, arrival: float | None, prompt_tokens: int,
                phase: str = "waiting") -> _Request:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self.num_slots = self.num_slots, self.num_slots + 1
        r = self._requests[rid] = _Request(slot, phase, arrival or 0.0, arrival, prompt_tokens)
        return r

    def _preempt(self, rid: str, at: float, events: list[LaneEvent]) -> None:
        r = self._requests.get(rid)
        if r is None:
            return
        self._close(rid, at, events)
        events.append(LaneInstant("preempted", rid, r.slot, at))
        r.phase, r.since = "waiting", at

    def _leave_queue(self, rid: str, at: float, events: list[LaneEvent]) -> None:
        r = self._requests.get(rid)
        if r is not None and r.phase == "waiting":
            self._close(rid, at, events)
            r.phase, r.since = "running", at

    def _chunk(self, rid: str, tokens: int, cached: int, start: float, end: float,
               events: list[LaneEvent]) -> None:
        r = self._requests.get(rid)
        if r is None:
            if not self.adopt:
                return
            r = self._arrive(rid, None, 0, phase="running")
        self._leave_queue(rid, start, events)  # a trace without admissions (older files)
        r.chunks += 1
        events.append(LaneSpan("prefill", rid, r.slot, start, end,
                               {"tokens": tokens, "start": cached, "chunk": r.chunks}))
        r.phase, r.since = "running", end

    def _first_token_or_resume(self, rid: str, at: float, events: list[LaneEvent]) -> None:
        r = self._requests.get(rid)
        if r is None:
            return
        if r.first_token is None:
            r.first_token = at
            args: dict[str, Any] = {"chunks": r.chunks}
            if r.arrival is not None:  # an adopted request's time to first token is unknown
                args = {"ttft_ms": round((at - r.arrival) * 1e3, 3), **args}
            events.append(LaneInstant("first token", rid, r.slot, at, args))
        r.phase, r.since = "decode", at

    def _close(self, rid: str, at: float, events: list[LaneEvent],
               open_at_end: bool = False) -> None:
        """Ends the request's open span (waiting or decode) at `at`."""
        r = self._requests[rid]
        if r.phase == "running" or at <= r.since:
            return  # between chunks nothing is open; a zero-length span says nothing
        args = self._span_args(r)
        if open_at_end:
            args["open_at_end"] = True
        events.append(LaneSpan(r.phase, rid, r.slot, r.since, at, args))

    @staticmethod
    def _span_args(r: _Request) -> dict[str, Any]:
        if r.phase == "waiting" and r.arrival is not None:  # an adopted one's prompt is unseen
            return {"prompt_tokens": r.prompt_tokens}
        return {}

    def _release(self, rid: str) -> None:
        heapq.heappush(self._free, self._requests.pop(rid).slot)
