"""The step trace as a timeline Perfetto (ui.perfetto.dev) and chrome://tracing open: Chrome's
trace-event JSON, built from the same step records as the JSONL trace (engine/trace.py).

What it shows (docs/trace.md walks through it):
- process "engine": one lane of steps, a complete event per step named by its shape
  ("prefill", "decode", "mixed") with its token counts, budget and KV blocks in `args`, and
  counter tracks for waiting, running, KV usage and preemptions (total);
- process "requests": a lane per request slot, so a thousand requests stay readable. A request
  holds the lowest free slot from its arrival to its end, and its lane shows it waiting, each
  prefill chunk, and decoding, with instants for its first token and for a preemption.
A simulated run says so in its process names and runs on the virtual clock, so a real and a
simulated run of one workload can be opened side by side.

Everything is derived from the records alone (`Timeline.add` takes them in order), so a JSONL
trace taken earlier converts to the same events as one written directly.
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from typing import IO, Any

from chunkserve.engine.trace import StepRecord, open_for_writing

ENGINE_PID, REQUESTS_PID = 1, 2
STEPS_TID = 1
Event = dict[str, Any]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # the format's unit; ns precision keeps the output stable


@dataclass
class _Request:
    slot: int
    phase: str  # "waiting", "running" (admitted: between chunks) or "decode"
    since: float  # when the open span began (seconds, engine clock)
    arrival: float
    prompt_tokens: int
    chunks: int = 0
    first_token: float | None = None


class Timeline:
    """Trace events from step records, given one at a time, in step order."""

    def __init__(self, simulated: bool = False) -> None:
        self.simulated = simulated
        self._requests: dict[str, _Request] = {}
        self._free: list[int] = []  # freed slots, lowest first
        self._slots = 0
        self._preemptions = 0
        self._t0: float | None = None
        self._end = 0.0

    def header(self) -> list[Event]:
        clock = "simulated clock" if self.simulated else "wall clock"
        return [metadata_event("process_name", ENGINE_PID, None, f"engine ({clock})"),
                metadata_event("process_name", REQUESTS_PID, None, f"requests ({clock})"),
                metadata_event("thread_name", ENGINE_PID, STEPS_TID, "steps"),
                metadata_event("process_sort_index", ENGINE_PID, None, 0, key="sort_index"),
                metadata_event("process_sort_index", REQUESTS_PID, None, 1, key="sort_index")]

    def add(self, rec: StepRecord) -> list[Event]:
        """The events this step completes."""
        start, end = rec.start, rec.start + rec.duration
        if self._t0 is None:
            self._t0 = min([start, *(a[1] for a in rec.arrived_requests)])
        self._end = end
        events: list[Event] = []
        for rid, arrival, prompt_tokens in rec.arrived_requests:
            self._arrive(rid, arrival, prompt_tokens, events)
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
            self._finish(rid, end, events)
        events.append(self._step_event(rec, start))
        events += self._counters(rec, start)
        return events

    def finish(self) -> list[Event]:
        """Spans still open at the last step's end (a run stopped mid-way), closed there."""
        events: list[Event] = []
        for rid in list(self._requests):
            self._close(rid, self._end, events, open_at_end=True)
            self._release(rid)
        return events

    # ---- requests ----------------------------------------------------------------------------
    def _arrive(self, rid: str, arrival: float, prompt_tokens: int, events: list[Event]) -> None:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._slots = self._slots, self._slots + 1
            events.append(metadata_event("thread_name", REQUESTS_PID, slot + 1, f"slot {slot}"))
            events.append(metadata_event("thread_sort_index", REQUESTS_PID, slot + 1, slot,
                                key="sort_index"))
        self._requests[rid] = _Request(slot, "waiting", arrival, arrival, prompt_tokens)

    def _preempt(self, rid: str, at: float, events: list[Event]) -> None:
        r = self._requests.get(rid)
        if r is None:
            return
        self._close(rid, at, events)
        self._preemptions += 1
        events.append(self._instant("preempted", r, at, {"request_id": rid}))
        r.phase, r.since = "waiting", at

    def _leave_queue(self, rid: str, at: float, events: list[Event]) -> None:
        r = self._requests.get(rid)
        if r is not None and r.phase == "waiting":
            self._close(rid, at, events)
            r.phase, r.since = "running", at

    def _chunk(self, rid: str, tokens: int, cached: int, start: float, end: float,
               events: list[Event]) -> None:
        r = self._requests.get(rid)
        if r is None:
            return
        self._leave_queue(rid, start, events)  # a trace without admissions (older files)
        r.chunks += 1
        events.append(self._span("prefill", r, start, end, {
            "request_id": rid, "tokens": tokens, "start": cached, "chunk": r.chunks}))
        r.phase, r.since = "running", end

    def _first_token_or_resume(self, rid: str, at: float, events: list[Event]) -> None:
        r = self._requests.get(rid)
        if r is None:
            return
        if r.first_token is None:
            r.first_token = at
            events.append(self._instant("first token", r, at, {
                "request_id": rid, "ttft_ms": round((at - r.arrival) * 1e3, 3),
                "chunks": r.chunks}))
        r.phase, r.since = "decode", at

    def _finish(self, rid: str, at: float, events: list[Event]) -> None:
        if rid in self._requests:
            self._close(rid, at, events)
            self._release(rid)

    def _close(self, rid: str, at: float, events: list[Event], open_at_end: bool = False) -> None:
        """Ends the request's open span (waiting or decode) at `at`."""
        r = self._requests[rid]
        if r.phase == "running" or at <= r.since:
            return  # between chunks nothing is open; a zero-length span says nothing
        args: dict[str, Any] = {"request_id": rid}
        if r.phase == "waiting":
            args["prompt_tokens"] = r.prompt_tokens
        if open_at_end:
            args["open_at_end"] = True
        events.append(self._span(r.phase, r, r.since, at, args))

    def _release(self, rid: str) -> None:
        heapq.heappush(self._free, self._requests.pop(rid).slot)

    # ---- events ------------------------------------------------------------------------------
    def ts(self, t: float) -> float:
        """An engine-clock time as the timeline's microseconds (after the first step is added)."""
        assert self._t0 is not None
        return _us(max(0.0, t - self._t0))

    def _span(self, name: str, r: _Request, start: float, end: float,
              args: dict[str, Any]) -> Event:
        ts = self.ts(start)
        return {"name": name, "cat": "request", "ph": "X", "ts": ts,
                "dur": max(0.0, round(self.ts(end) - ts, 3)), "pid": REQUESTS_PID,
                "tid": r.slot + 1, "args": args}

    def _instant(self, name: str, r: _Request, at: float, args: dict[str, Any]) -> Event:
        return {"name": name, "cat": "request", "ph": "i", "s": "t", "ts": self.ts(at),
                "pid": REQUESTS_PID, "tid": r.slot + 1, "args": args}

    def _step_event(self, rec: StepRecord, start: float) -> Event:
        shape = ("mixed" if rec.num_prefill_tokens and rec.num_decode_tokens
                 else "prefill" if rec.num_prefill_tokens else "decode")
        ts = self.ts(start)
        args = {"step": rec.step, "prefill_tokens": rec.num_prefill_tokens,
                "decode_tokens": rec.num_decode_tokens, "token_budget": rec.token_budget,
                "prefill_requests": rec.num_prefill_reqs, "decode_requests": rec.num_decode_reqs,
                "kv_blocks_used": rec.kv_blocks_used, "preemptions": rec.num_preemptions}
        return {"name": shape, "cat": "step", "ph": "X", "ts": ts,
                "dur": max(0.0, round(self.ts(start + rec.duration) - ts, 3)),
                "pid": ENGINE_PID, "tid": STEPS_TID, "args": args}

    def _counters(self, rec: StepRecord, start: float) -> list[Event]:
        ts = self.ts(start)
        values = {"waiting": rec.num_waiting, "running": rec.num_running,
                  "KV usage (%)": round(rec.kv_usage * 100, 2),
                  "preemptions (total)": self._preemptions}
        return [{"name": name, "cat": "counter", "ph": "C", "ts": ts, "pid": ENGINE_PID,
                 "args": {name: value}} for name, value in values.items()]


def metadata_event(name: str, pid: int, tid: int | None, value: Any, key: str = "name") -> Event:
    """A "M" event: names (or orders) a process, or a lane when `tid` is given."""
    event: Event = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


class TimelineWriter:
    """Writes a timeline file as steps come (`--trace-format perfetto`): the events so far are on
    disk, and `close` ends the JSON object."""

    def __init__(self, path: str, simulated: bool = False) -> None:
        self._timeline = Timeline(simulated)
        self._file: IO[str] | None = open_for_writing(path)
        self._first = True
        self._file.write('{"traceEvents": [\n')
        self._write(self._timeline.header())

    def add(self, record: StepRecord) -> None:
        self._write(self._timeline.add(record))

    def close(self) -> None:
        if self._file is None:
            return
        self._write(self._timeline.finish())
        clock = "simulated" if self._timeline.simulated else "wall"
        self._file.write('\n], "displayTimeUnit": "ms", "otherData": {"source": "chunkserve", '
                         f'"clock": "{clock}"}}}}\n')
        self._file.close()
        self._file = None

    def _write(self, events: list[Event]) -> None:
        assert self._file is not None
        for event in events:
            self._file.write(("" if self._first else ",\n") + json.dumps(event))
            self._first = False


def write_timeline(path: str, records: list[StepRecord], simulated: bool = False) -> None:
    writer = TimelineWriter(path, simulated)
    for record in records:
        writer.add(record)
    writer.close()
