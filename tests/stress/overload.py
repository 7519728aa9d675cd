"""Phase (c): an overload burst. With every running slot busy, five times
--max-waiting-requests arrive at once: the server must admit exactly the cap and refuse the
rest with 503 + Retry-After, the waiting queue must never exceed the cap (checked on /metrics
throughout, and in every 503's own count), every admitted request must complete, and the
waiting gauge read right after a 503 must not show fewer than the 503 said were waiting (one
count for both, issue 27), nor may the rejected counter miss a 503."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
from server_utils import Metrics

from stress.fuzz import check_response
from stress.report import PhaseResult
from stress.target import Target
from stress.wire import WireResponse


class _GaugeCheck:
    """After a 503: /metrics at once. While no request has finished since the burst began (the
    fillers hold every running slot, so nothing admitted can start), the waiting count cannot
    have dropped, and the gauge must show at least what the 503 said."""

    def __init__(self) -> None:
        self.finished_before: float | None = None  # request_success_total at the gate
        self.checked = 0
        self.skipped = 0

    @staticmethod
    async def scrape(client: httpx.AsyncClient) -> Metrics:
        return Metrics((await client.get("/metrics")).text)

    async def __call__(self, client: httpx.AsyncClient, said: int, result: PhaseResult) -> None:
        m = await self.scrape(client)
        if self.finished_before is None or _finished(m) != self.finished_before:
            self.skipped += 1  # a filler ended: places may rightly have freed since the 503
            return
        self.checked += 1
        if m.waiting < said:
            result.fail(f"a 503 said {said} requests are waiting; /metrics right after: "
                        f"{m.waiting:g}")


def _finished(m: Metrics) -> float:
    return sum(v for (name, _), v in m.samples.items() if name == "vllm:request_success_total")


def _rejected(m: Metrics) -> float:
    return m.get("vllm:num_requests_rejected_total", reason="queue_full")


async def _request(client: httpx.AsyncClient, i: int, tokens: int, gate: asyncio.Event,
                   cap: int, result: PhaseResult, gauge: _GaugeCheck | None = None) -> None:
    body = {"prompt": f"Request {i}: the history of", "max_tokens": tokens, "ignore_eos": True,
            "stream": i % 2 == 0}
    await gate.wait()
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.TransportError as e:
        result.requests += 1
        result.resets += 1
        result.fail(f"request {i}: {type(e).__name__}: {e}")
        return
    result.record(r.status_code)
    headers = {k.lower(): v for k, v in r.headers.items()}
    check_response(f"burst {i}", WireResponse(r.status_code, headers, r.content), result)
    if r.status_code == 503:
        said = _check_503(r, cap, result)
        if said is not None and gauge is not None:
            await gauge(client, said, result)


def run_overload(target: Target, factor: int, max_tokens: int, num_slots: int,
                 filler_tokens: int) -> PhaseResult:
    """`num_slots` fillers (--max-num-seqs) of `filler_tokens` occupy the engine first."""
    result = PhaseResult("overload burst", allow_503=True)
    cap = target.max_waiting
    num = factor * cap
    peak_waiting = 0.0
    done = threading.Event()
    gauge = _GaugeCheck()
    rejected = [0.0, 0.0]  # vllm:num_requests_rejected_total{reason="queue_full"}: before, after

    def watch() -> None:
        nonlocal peak_waiting
        while not done.is_set():
            peak_waiting = max(peak_waiting, target.server.metrics().waiting)
            time.sleep(0.005)

    async def main() -> None:
        limits = httpx.Limits(max_connections=num + num_slots + 4)
        async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=300,
                                     limits=limits) as client:
            gate = asyncio.Event()
            gate.set()  # the fillers go first and take every running slot
            fillers = [asyncio.create_task(_request(client, -1 - i, filler_tokens, gate, cap,
                                                    result)) for i in range(num_slots)]
            while (await asyncio.to_thread(target.server.metrics)).running < num_slots:
                await asyncio.sleep(0.02)
            gate.clear()
            burst = [asyncio.create_task(_request(client, i, max_tokens, gate, cap, result,
                                                  gauge))
                     for i in range(num)]
            await asyncio.sleep(0.2)  # every request of the burst is parked on the gate
            m = await gauge.scrape(client)
            gauge.finished_before, rejected[0] = _finished(m), _rejected(m)
            gate.set()
            await asyncio.gather(*burst, *fillers)
            rejected[1] = _rejected(await gauge.scrape(client))

    watcher = threading.Thread(target=watch, daemon=True)
    start = time.monotonic()
    watcher.start()
    try:
        asyncio.run(main())
    finally:
        done.set()
        watcher.join(10)
    result.seconds = time.monotonic() - start
    admitted = result.statuses[200] - num_slots
    if peak_waiting > cap:
        result.fail(f"waiting reached {peak_waiting:g} > cap {cap}")
    if admitted != cap:
        result.fail(f"{admitted} of the burst admitted, not the cap ({cap})")
    if rejected[1] - rejected[0] != result.statuses[503]:
        result.fail(f"rejected_total{{reason=queue_full}} rose by {rejected[1] - rejected[0]:g}"
                    f" for {result.statuses[503]} 503s")
    result.notes.append(f"{num} requests at once against --max-waiting-requests {cap}, "
                        f"{num_slots} running: {admitted} admitted, {result.statuses[503]} "
                        f"refused, peak waiting {peak_waiting:g}; waiting gauge >= the 503's "
                        f"count in {gauge.checked} of {gauge.checked + gauge.skipped} "
                        "(the rest after a filler ended)")
    return result


def _check_503(r: httpx.Response, cap: int, result: PhaseResult) -> int | None:
    """The number of waiting requests the 503 states, checked against the cap."""
    if r.headers.get("retry-after") is None:
        result.fail("503 without Retry-After")
    message = r.json()["error"]["message"]
    said = re.search(r"(\d+) requests are waiting", message)
    if said is None or int(said.group(1)) > cap:
        result.fail(f"503 message: {message}")
    return None if said is None else int(said.group(1))
