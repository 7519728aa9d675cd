"""`diagnose --perfetto OUT.json`: the step trace's timeline (engine/timeline.py) with the worst
token gaps drawn on it, each named by its attributed cause.

Each gap becomes a slice on an engine lane, "token gaps (diagnose)". It is also drawn on the
lane of every request that decoded across the whole gap, nested inside that request's decode
slice. Its `args` carry the gap's length, the seconds it spent on each cause, and the culprit
(the step and the request behind it). Perfetto then shows who waited, how long, and why.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from chunkserve.diagnose.causes import Attributed, attribute_all
from chunkserve.diagnose.gaps import end
from chunkserve.engine.timeline import ENGINE_PID, Event, Timeline, metadata_event
from chunkserve.engine.trace import StepRecord, open_for_writing

GAPS_TID = 2


def write_diagnosed_timeline(path: str, records: Sequence[StepRecord], worst: int = 20,
                             simulated: bool = False) -> int:
    """Writes the timeline with the `worst` longest gaps annotated; returns how many."""
    timeline = Timeline(simulated)
    events = timeline.header()
    for record in records:
        events += timeline.add(record)
    events += timeline.finish()
    _, attributed = attribute_all(records)
    chosen = sorted(attributed, key=lambda a: -a.gap.seconds)[:worst]
    events.append(metadata_event("thread_name", ENGINE_PID, GAPS_TID, "token gaps (diagnose)"))
    decodes = [e for e in events if e.get("cat") == "request" and e["name"] == "decode"]
    for a in chosen:
        events += _gap_events(a, records, timeline, decodes)
    with open_for_writing(path, "timeline") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"source": "chunkserve diagnose"}}, f)
    return len(chosen)


def _gap_events(a: Attributed, records: Sequence[StepRecord], timeline: Timeline,
                decodes: list[Event]) -> list[Event]:
    stop = end(records[a.gap.last])
    ts, te = timeline.ts(stop - a.gap.seconds), timeline.ts(stop)
    args: dict[str, Any] = {
        "gap_ms": round(a.gap.seconds * 1e3, 3), "cause": a.cause, "tokens": a.gap.count,
        "parts_ms": {k: round(v * 1e3, 3) for k, v in a.parts.items() if v > 0},
        "culprit": a.culprit}
    slice_ = {"name": a.cause, "cat": "diagnose", "ph": "X", "ts": ts,
              "dur": round(te - ts, 3), "pid": ENGINE_PID, "tid": GAPS_TID, "args": args}
    events = [slice_]
    for d in decodes:  # the requests that waited through all of it
        if d["ts"] <= ts and d["ts"] + d["dur"] >= te:
            events.append({**slice_, "pid": d["pid"], "tid": d["tid"],
                           "args": {**args, "request_id": d["args"]["request_id"]}})
    return events
