"""Phase (e): SIGTERM with streams in flight. Requests that finish within the grace period
are delivered whole; every stream still running at its end ends with an error event and
`data: [DONE]` (a non-streamed one gets a 503), and the process exits 0 within the grace period
(--shutdown-timeout), with no traceback in its log."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from stress.report import PhaseResult
from stress.sse import is_error_event
from stress.target import Target



@dataclass
class _Stream:
    kind: str  # "long" (outlives the grace period) or "short" (finishes within it)
    stream: bool
    events: list[str] = field(default_factory=list)
    status: int = 0
    error: str | None = None  # a transport error: the body was cut
    first: asyncio.Event = field(default_factory=asyncio.Event)


async def _consume(client: httpx.AsyncClient, s: _Stream, body: dict[str, Any]) -> None:
    try:
        if s.stream:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                s.status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        s.events.append(line)
                        s.first.set()
        else:
            s.first.set()
            r = await client.post("/v1/completions", json=body)
            s.status, s.events = r.status_code, [r.text]
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        s.first.set()


def _judge(s: _Stream, result: PhaseResult) -> None:
    label = f"{s.kind} {'stream' if s.stream else 'request'}"
    if s.error is not None:
        result.resets += 1
        result.fail(f"{label} was cut: {s.error} after {len(s.events)} events")
        return
    result.record(s.status)
    if not s.stream:
        body = json.loads(s.events[0])
        want = 200 if s.kind == "short" else 503
        if s.status != want or (want == 503 and body["error"]["type"] != "ServiceUnavailableError"):
            result.fail(f"{label}: {s.status} {s.events[0][:200]}")
        return
    last = s.events[-1] if s.events else ""
    errors = [e for e in s.events if is_error_event(e)]
    if last != "data: [DONE]":
        result.fail(f"{label}: did not end with [DONE] (last {last[:80]!r})")
    elif s.kind == "long" and (len(errors) != 1 or s.events[-2] != errors[0]):
        result.fail(f"{label}: no error event just before [DONE]: {s.events[-2][:160]}")
    elif s.kind == "short" and (errors or '"finish_reason": "length"' not in "".join(s.events)):
        result.fail(f"{label}: finished work not delivered whole: {s.events[-2][:160]}")


def run_shutdown(target: Target, grace_s: float, num_long: int, max_model_len: int) -> PhaseResult:
    result = PhaseResult("SIGTERM", allow_503=True)
    proc = target.server.proc
    assert proc is not None
    long_body = {"prompt": "Once upon a time", "max_tokens": max_model_len - 8, "ignore_eos": True}
    short_body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    timing: dict[str, float] = {}

    async def main() -> list[_Stream]:
        limits = httpx.Limits(max_connections=num_long + 4)
        async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=60,
                                     limits=limits) as client:
            streams = [_Stream("long", i != 0) for i in range(num_long)]  # one non-streamed
            tasks = []
            for s in streams:  # one at a time: simultaneous arrivals may exceed a small cap
                tasks.append(asyncio.create_task(
                    _consume(client, s, {**long_body, "stream": s.stream})))
                await asyncio.wait_for(s.first.wait(), 60)
                while s.stream is False and (await asyncio.to_thread(
                        target.server.metrics)).running < len(tasks):
                    await asyncio.sleep(0.02)
            short = [_Stream("short", True), _Stream("short", False)]
            tasks += [asyncio.create_task(_consume(client, s, {**short_body, "stream": s.stream}))
                      for s in short]
            await asyncio.sleep(0.05)  # the short ones are in flight too
            timing["signal"] = time.monotonic()
            proc.terminate()
            await asyncio.wait_for(asyncio.gather(*tasks), grace_s + 30)
            timing["streams_done"] = time.monotonic()
            return streams + short

    streams = asyncio.run(main())
    try:
        code = proc.wait(grace_s + 30)
    except Exception:  # noqa: BLE001 - a hung server: record, then kill
        proc.kill()
        code = None
    exited = time.monotonic() - timing["signal"]
    for s in streams:
        _judge(s, result)
    if code != 0:
        result.fail(f"exit code {code}")
    if exited > grace_s:
        result.fail(f"exited {exited:.2f} s after SIGTERM, past the grace period ({grace_s:g} s)")
    result.seconds = exited
    result.notes.append(f"{num_long} long requests in flight ({num_long - 1} streams), 2 short: "
                        f"streams ended {timing['streams_done'] - timing['signal']:.2f} s and the "
                        f"process exited ({code}) {exited:.2f} s after SIGTERM, grace {grace_s:g} s")
    return result
