"""Phase (c): an overload burst. With every running slot busy, five times
--max-waiting-requests arrive at once: the server must admit exactly the cap and refuse the
rest with 503 + Retry-After, the waiting queue must never exceed the cap (checked on /metrics
throughout, and in every 503's own count), and every admitted request must complete."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx

from stress.fuzz import check_response
from stress.report import PhaseResult
from stress.target import Target
from stress.wire import WireResponse


async def _request(client: httpx.AsyncClient, i: int, tokens: int, gate: asyncio.Event,
                   cap: int, result: PhaseResult) -> None:
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
        _check_503(r, cap, result)


def run_overload(target: Target, factor: int, max_tokens: int, num_slots: int,
                 filler_tokens: int) -> PhaseResult:
    """`num_slots` fillers (--max-num-seqs) of `filler_tokens` occupy the engine first."""
    result = PhaseResult("overload burst", allow_503=True)
    cap = target.max_waiting
    num = factor * cap
    peak_waiting = 0.0
    done = threading.Event()

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
            burst = [asyncio.create_task(_request(client, i, max_tokens, gate, cap, result))
                     for i in range(num)]
            await asyncio.sleep(0.2)  # every request of the burst is parked on the gate
            gate.set()
            await asyncio.gather(*burst, *fillers)

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
    result.notes.append(f"{num} requests at once against --max-waiting-requests {cap}, "
                        f"{num_slots} running: {admitted} admitted, {result.statuses[503]} "
                        f"refused, peak waiting {peak_waiting:g}")
    return result


def _check_503(r: httpx.Response, cap: int, result: PhaseResult) -> None:
    if r.headers.get("retry-after") is None:
        result.fail("503 without Retry-After")
    message = r.json()["error"]["message"]
    said = re.search(r"(\d+) requests are waiting", message)
    if said is None or int(said.group(1)) > cap:
        result.fail(f"503 message: {message}")
