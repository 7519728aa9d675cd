"""The step trace as a timeline Perfetto (ui.perfetto.dev) and chrome://tracing open: Chrome's
trace-event JSON, built from the same step records as the JSONL trace (engine/trace.py).

What it shows (docs/trace.md walks through it):
- process "engine": one lane of steps, a complete event per step named by its shape
  ("prefill", "decode", "mixed") with its token counts, budget and KV blocks in `args`, and
  counter tracks for waiting, running, KV usage and preemptions (total);
- process "requests": a lane per request slot, so a thousand requests stay readable. A request
  holds the lowest free slot from its arrival to its end, and its lane shows it waiting, each
  prefill chunk, and decoding, with instants for its first token and for a preemption (the
  rule is engine/lanes.py's, which the web page's live view uses too).
A simulated run says so in its process names and runs on the virtual clock, so a real and a
simulated run of one workload can be opened side by side.

Everything is derived from the records alone (`Timeline.add` takes them in order), so a JSONL
trace taken earlier converts to the same events as one written directly.
"""
from __future__ import annotations

import json
from typing import IO, Any

from chunkserve.engine.lanes import LaneEvent, LaneInstant, Lanes
from chunkserve.engine.trace import StepRecord, open_for_writing

ENGINE_PID, REQUESTS_PID = 1, 2
STEPS_TID = 1
Event = dict[str, Any]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # the format's unit; ns precision keeps the output stable


class Timeline:
    """Trace events from step records, given one at a time, in step order."""

    def __init__(self, simulated: bool = False) -> None:
        self.simulated = simulated
        self._lanes = Lanes()  # the request lanes' rule, shared with the web page's stream
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
        slots = self._lanes.num_slots
        lane_events = self._lanes.add(rec)
        events: list[Event] = []
        for slot in range(slots, self._lanes.num_slots):  # lanes first used in this step
            events.append(metadata_event("thread_name", REQUESTS_PID, slot + 1, f"slot {slot}"))
            events.append(metadata_event("thread_sort_index", REQUESTS_PID, slot + 1, slot,
                                         key="sort_index"))
        for lane_event in lane_events:
            events.append(self._lane_event(lane_event))
            self._preemptions += lane_event.kind == "preempted"
        events.append(self._step_event(rec, start))
        events += self._counters(rec, start)
        return events

    def finish(self) -> list[Event]:
        """Spans still open at the last step's end (a run stopped mid-way), closed there."""
        return [self._lane_event(span) for span in self._lanes.finish(self._end)]

    # ---- events ------------------------------------------------------------------------------
    def ts(self, t: float) -> float:
        """An engine-clock time as the timeline's microseconds (after the first step is added)."""
        assert self._t0 is not None
        return _us(max(0.0, t - self._t0))

    def _lane_event(self, e: LaneEvent) -> Event:
        """A lane span as a complete event, an instant as an instant, on the slot's lane."""
        args = {"request_id": e.request_id, **e.args}
        if isinstance(e, LaneInstant):
            return {"name": e.kind, "cat": "request", "ph": "i", "s": "t", "ts": self.ts(e.at),
                    "pid": REQUESTS_PID, "tid": e.slot + 1, "args": args}
        assert e.end is not None  # closed spans only: open ones are closed by `finish`
        ts = self.ts(e.start)
        return {"name": e.kind, "cat": "request", "ph": "X", "ts": ts,
                "dur": max(0.0, round(self.ts(e.end) - ts, 3)), "pid": REQUESTS_PID,
                "tid": e.slot + 1, "args": args}

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
