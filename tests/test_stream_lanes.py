"""The web page's request lanes, computed by the step stream (serve/step_stream.py) with the
trace timeline's rule (engine/lanes.py): the same slots and spans as the Perfetto timeline for
the same records, one lane assigner per engine, and the page left only drawing them."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chunkserve.cli import main
from chunkserve.engine.timeline import REQUESTS_PID, Timeline
from chunkserve.engine.trace import StepRecord, read_trace
from chunkserve.serve.step_stream import StepStream, StepWindow


def record(step: int, start: float, **events: Any) -> StepRecord:
    return StepRecord(step=step, start=start, duration=0.01, num_prefill_tokens=0,
                      num_decode_tokens=0, num_prefill_reqs=0, num_decode_reqs=0,
                      num_running=0, num_waiting=0, kv_usage=0.0, kv_blocks_used=0,
                      internal_fragmentation=0, num_preemptions=0, num_swapped_blocks=0,
                      **events)


# Three requests: a (two chunks, decodes, finishes), b (one chunk, preempted, waits again),
# c (arrives after a ends and takes its slot, the lowest free).
SCENARIO = [
    record(0, 100.0, arrived_requests=[["a", 99.9, 100], ["b", 99.95, 50]],
           admitted_requests=["a"], prefill_requests=[["a", 64, 0]]),
    record(1, 100.01, admitted_requests=["b"], prefill_requests=[["a", 36, 64], ["b", 50, 0]],
           sampled_prefills=["a", "b"]),
    record(2, 100.02, finished_requests=["a"]),
    record(3, 100.03, arrived_requests=[["c", 100.025, 10]], preempted_requests=["b"]),
]


def stream(records: list[StepRecord], every: int = 1) -> list[dict[str, Any]]:
    """The summaries of one engine's window, one taken after every `every` records."""
    window, out = StepWindow(interval=0.05), []
    for i, rec in enumerate(records, 1):
        window.add(rec)
        if i % every == 0 or i == len(records):
            out.append(window.take(i * 1.0))
    return out


def test_lanes_follow_each_request_in_the_lowest_free_slot():
    summaries = stream(SCENARIO)
    spans = [(s["request_id"], s["kind"], s["slot"]) for x in summaries for s in x["spans"]]
    assert [k for rid, k, _ in spans if rid == "a"] == ["waiting", "prefill", "prefill", "decode"]
    assert [k for rid, k, _ in spans if rid == "b"] == ["waiting", "prefill", "decode"]
    slot = {rid: s for rid, _, s in spans}
    instants = [(i["request_id"], i["kind"]) for x in summaries for i in x["instants"]]
    assert instants == [("a", "first token"), ("b", "first token"), ("b", "preempted")]
    # At the end: b waits again (preempted), c waits in a's freed slot; a holds none.
    last = summaries[-1]["open"]
    assert {(s["request_id"], s["kind"], s["slot"]) for s in last} == {
        ("b", "waiting", slot["b"]), ("c", "waiting", slot["a"])}
    assert all("end" not in s for s in last)  # open: the page draws it up to now
    decode_a = next(s for x in summaries for s in x["spans"]
                    if s["request_id"] == "a" and s["kind"] == "decode")
    assert (decode_a["start"], decode_a["end"]) == (pytest.approx(100.02), pytest.approx(100.03))
    assert [s["request_id"] for s in summaries[1]["open"]] == ["a", "b"]  # both decoding


def test_a_page_opened_mid_run_adopts_requests_at_their_next_chunk():
    # The window never saw "x" arrive: its chunk still gets a lane, its TTFT is not guessed.
    summary = stream([record(7, 5.0, prefill_requests=[["x", 16, 32]],
                             sampled_prefills=["x"])])[0]
    assert [(s["request_id"], s["kind"], s["slot"]) for s in summary["spans"]] == [
        ("x", "prefill", 0)]
    assert summary["instants"] == [{"kind": "first token", "request_id": "x", "slot": 0,
                                    "at": pytest.approx(5.01), "args": {"chunks": 1}}]
    assert [s["kind"] for s in summary["open"]] == ["decode"]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> list[StepRecord]:
    """A simulated run whose KV pool is small enough that requests are preempted."""
    out = tmp_path_factory.mktemp("lanes")
    assert main(["sim", "--hardware", "a100-80gb", "--model", "llama-3-8b", "--dataset-name",
                 "mixed", "--num-prompts", "30", "--request-rate", "8", "--chunk-sizes", "256",
                 "--seed", "3", "--num-kv-blocks", "250", "--max-model-len", "3400",
                 "--out", str(out / "out"), "--trace-dir", str(out / "traces")]) == 0
    return read_trace(str(out / "traces" / "steps-256.jsonl"))


def _perfetto_lanes(records: list[StepRecord]) -> tuple[Timeline, list[tuple], list[tuple]]:
    """The timeline's request events as (kind, request, slot, ts, dur or None)."""
    timeline = Timeline()
    events = [e for rec in records for e in timeline.add(rec)]
    events += timeline.finish()
    spans = [(e["name"], e["args"]["request_id"], e["tid"] - 1, e["ts"], e["dur"],
              bool(e["args"].get("open_at_end"))) for e in events
             if e["pid"] == REQUESTS_PID and e["ph"] == "X"]
    instants = [(e["name"], e["args"]["request_id"], e["tid"] - 1, e["ts"]) for e in events
                if e["pid"] == REQUESTS_PID and e["ph"] == "i"]
    return timeline, spans, instants


@pytest.mark.parametrize("cut", [None, 200])  # the whole run, and one stopped mid-way
def test_the_streams_lanes_are_the_timelines(simulated: list[StepRecord], cut: int | None):
    records = simulated[:cut]
    timeline, spans, instants = _perfetto_lanes(records)
    assert sum(k == "preempted" for k, *_ in instants) > 0  # the rule's hard case is in it
    summaries = stream(records, every=7)
    ts = timeline.ts

    def dur(start: float, end: float) -> float:
        return max(0.0, round(ts(end) - ts(start), 3))

    got = [(s["kind"], s["request_id"], s["slot"], ts(s["start"]), dur(s["start"], s["end"]),
            False) for x in summaries for s in x["spans"]]
    # What the timeline closes at the end, the stream still shows open.
    end = records[-1].start + records[-1].duration
    got += [(s["kind"], s["request_id"], s["slot"], ts(s["start"]), dur(s["start"], end), True)
            for s in summaries[-1]["open"] if end > s["start"]]
    assert got == spans
    assert [(i["kind"], i["request_id"], i["slot"], ts(i["at"]))
            for x in summaries for i in x["instants"]] == instants
    assert [st["step"] for x in summaries for st in x["steps"]] == [r.step for r in records]


def test_each_engine_has_its_own_lanes_and_summaries():
    # Two data-parallel engines, each with a request "r0" (ids are per engine's clients).
    s = StepStream(interval=0.01)

    async def watch() -> list[dict[str, Any]]:
        it = s.summaries()
        first = asyncio.ensure_future(it.__anext__())
        while s.subscribers == 0:
            await asyncio.sleep(0.001)
        for engine in (0, 1):
            s.observe(record(0, 1.0, arrived_requests=[["r0", 1.0, 8], ["r1", 1.0, 8]]), engine)
        s.observe(record(1, 1.01, prefill_requests=[["r1", 8, 0]]), 1)
        got = [await asyncio.wait_for(first, 2)]
        while len(got) < 2:
            got.append(await asyncio.wait_for(it.__anext__(), 2))
        await it.aclose()
        return got

    summaries = sorted(asyncio.run(watch()), key=lambda x: x["engine"])
    assert [x["engine"] for x in summaries] == [0, 1]
    for x in summaries:
        assert {st["engine"] for st in x["steps"]} == {x["engine"]}
        slots = {sp["request_id"]: sp["slot"] for sp in x["spans"] + x["open"]}
        assert slots == {"r0": 0, "r1": 1}  # each engine's lanes start at slot 0
    assert [st["step"] for st in summaries[1]["steps"]] == [0, 1]
    assert [sp["kind"] for sp in summaries[1]["spans"]] == ["waiting", "prefill"]  # its own
    assert summaries[0]["spans"] == []


def test_decimation_is_per_engine():
    # A fast engine and a slow one: each gets at most one summary per interval.
    windows = {0: StepWindow(0.05, engine=0), 1: StepWindow(0.05, engine=1)}
    emitted = {0: 0, 1: 0}
    for i in range(1000):
        now = i * 0.001
        windows[0].add(record(i, now))
        if i % 10 == 0:
            windows[1].add(record(i // 10, now))
        for engine, w in windows.items():
            emitted[engine] += w.take(now) is not None
    assert 19 <= emitted[0] <= 21 and 19 <= emitted[1] <= 21

