"""The step stream's decimation (serve/step_stream.py): pure, driven by made-up clocks."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from chunkserve.engine.trace import StepRecord
from chunkserve.serve.step_stream import StepStream, StepWindow, step_summary


def record(step: int, start: float = 0.0, prefill: int = 0, decode: int = 0,
           waiting: int = 0, running: int = 0, kv: float = 0.0, **extra) -> StepRecord:
    return StepRecord(step=step, start=start, duration=0.01, num_prefill_tokens=prefill,
                      num_decode_tokens=decode, num_prefill_reqs=1 if prefill else 0,
                      num_decode_reqs=decode, num_running=running, num_waiting=waiting,
                      kv_usage=kv, kv_blocks_used=0, internal_fragmentation=0,
                      num_preemptions=0, num_swapped_blocks=0, **extra)


def test_one_summary_per_window_with_every_step_of_it():
    w = StepWindow(interval=0.05)
    assert w.take(0.0) is None  # nothing yet
    for i in range(5):
        w.add(record(i, start=i * 0.001, decode=2, running=i))
    first = w.take(0.0)
    assert first is not None and [s["step"] for s in first["steps"]] == [0, 1, 2, 3, 4]
    w.add(record(5, waiting=3, running=7, kv=0.25))
    assert w.take(0.02) is None  # within the window: held, not dropped
    w.add(record(6, waiting=2, running=8, kv=0.5))
    assert w.wait(0.03) == pytest.approx(0.02)
    second = w.take(0.05)
    assert second is not None and [s["step"] for s in second["steps"]] == [5, 6]
    # The state is the latest record's.
    assert (second["kv_usage"], second["waiting"], second["running"]) == (0.5, 2, 8)
    assert w.take(1.0) is None  # emptied


def test_at_most_one_summary_per_interval_under_a_fast_engine():
    w = StepWindow(interval=0.05)
    emitted, now = 0, 0.0
    for i in range(1000):  # 1,000 steps a second for one second
        now = i * 0.001
        w.add(record(i, start=now, decode=1))
        if w.take(now) is not None:
            emitted += 1
    assert 19 <= emitted <= 21


def test_summary_fields_and_events():
    r = record(3, start=1.5, prefill=64, decode=4, token_budget=68,
               prefill_requests=[["a", 64, 128]])
    s = step_summary(r, engine=1)
    assert s == {"step": 3, "engine": 1, "start": 1.5, "duration": 0.01, "prefill_tokens": 64,
                 "decode_tokens": 4, "budget": 68, "preemptions": 0,
                 "chunks": [["a", 64, 128]]}
    assert "chunks" not in step_summary(record(4, decode=1), engine=0)  # only what happened


def test_stream_costs_nothing_unwatched_and_ends_its_subscription():
    stream = StepStream(interval=0.01)
    stream.observe(record(0))  # nobody: dropped at once
    assert stream.subscribers == 0

    async def watch() -> dict:
        it = stream.summaries()
        task = asyncio.ensure_future(it.__anext__())
        while stream.subscribers == 0:
            await asyncio.sleep(0.001)
        stream.observe(record(1, decode=3, running=3), 0)
        summary = await asyncio.wait_for(task, 2)
        await it.aclose()
        return summary

    summary = asyncio.run(watch())
    assert [s["step"] for s in summary["steps"]] == [1] and summary["running"] == 3
    assert stream.subscribers == 0



@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_page_that_goes_away_stops_being_a_subscriber(spec_version):
    # 2.3 (uvicorn's): Starlette watches for the disconnect message; 2.4: the write fails, and
    # Starlette raises ClientDisconnect.
    from starlette.requests import ClientDisconnect

    from chunkserve.serve.routes.web import _events, _StepsResponse

    stream = StepStream(interval=0.01)
    sent: list[dict] = []
    gone = asyncio.Event()

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set() and spec_version == "2.4":
            raise OSError("connection reset")
        sent.append(message)

    async def run() -> None:
        response = _StepsResponse(_events(stream), media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        task = asyncio.ensure_future(response(scope, receive, send))
        while stream.subscribers == 0:
            await asyncio.sleep(0.001)
        stream.observe(record(1, decode=1))
        while not any(b"steps" in m.get("body", b"") for m in sent):
            await asyncio.sleep(0.001)
        gone.set()
        stream.observe(record(2, decode=1))  # the next write finds the client gone
        with contextlib.suppress(ClientDisconnect):
            await asyncio.wait_for(task, 2)

    asyncio.run(run())
    assert stream.subscribers == 0
