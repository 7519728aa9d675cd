"""Admission against --max-waiting-requests (serve/admission.py): the waiting gauge is the count
admission compares with the cap, a request of n > 1 reserves places as they free instead of
starving, and refusals are counted by reason.

The first tests play the engine thread by hand (an AsyncEngine that is never started: the test
publishes the engine's waiting count itself), so every interleaving is exact; the last ones run
a real server under a burst and under steady background load.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import HTTP_TIMEOUT_S, RemoteServer, assert_error

from chunkserve.serve.admission import Admission, ClientGone, Refused
from chunkserve.engine.llm_engine import EngineStats
from chunkserve.frontend.async_engine import AsyncEngine
from chunkserve.engine.engine_loop import LoopEvent
from chunkserve.serve.metrics import REJECT_REASONS, ServerMetrics
from chunkserve.serve.openai.serving import ApiError, Serving

# ---- in process: the engine thread played by the test -----------------------------------------


class _Client:
    """An engine client whose loop the test plays: it records commands and never applies
    them; `publish` emits the event the loop sends after a step."""

    index = 0
    info = SimpleNamespace(block_size=16, processor=None)

    def __init__(self) -> None:
        self.alive = True
        self.sent: list[object] = []

    def start(self, handle: Any) -> None:
        self.handle = handle

    def send(self, command: object) -> None:
        self.sent.append(command)

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self, timeout: float) -> None:
        self.alive = False


class Harness:
    def __init__(self, cap: int | None, timeout_s: float = 30.0) -> None:
        self.client = _Client()
        self.metrics = ServerMetrics("m", 256)
        self.ae = AsyncEngine([self.client], [self.metrics])  # type: ignore[list-item]
        self.metrics.track_waiting(0, lambda: self.ae.gauge_queued(0))
        self.ae.start()  # "the loop runs": healthy
        self.admission = Admission(self.ae, cap, timeout_s)

    async def publish(self, num_waiting: int) -> None:
        """The engine thread's end of a step: its waiting queue now holds `num_waiting`."""
        stats = EngineStats(num_running=0, num_waiting=num_waiting, kv_usage=0.0,
                            kv_internal_fragmentation=0)
        await asyncio.to_thread(self.client.handle, 0, LoopEvent(stats=stats))
        await asyncio.sleep(0.01)  # the loop runs the wake-up the engine thread scheduled

    def gauge(self) -> float:
        return _scrape(self.metrics.render()[0].decode(), "vllm:num_requests_waiting")


def _scrape(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def _claimed(message: str) -> int:
    said = re.search(r"(\d+) requests are waiting", message)
    assert said, message
    return int(said.group(1))


def test_size_one_never_waits_and_the_gauge_is_what_the_503_says():
    async def main() -> None:
        h = Harness(cap=2)
        await h.publish(1)
        held = await h.admission.admit(1)  # reserved, not yet sent: waiting, on the gauge too
        assert h.ae.num_queued == 2 and h.gauge() == 2
        t0 = time.monotonic()
        with pytest.raises(Refused) as e:
            await h.admission.admit(1)
        assert time.monotonic() - t0 < 0.1 and e.value.reason == "queue_full"
        assert _claimed(e.value.message) == 2 == h.gauge()
        held.release()
        assert h.gauge() == 1

    asyncio.run(main())


def test_n_reserves_places_as_they_free_and_newcomers_get_503():
    async def main() -> None:
        h = Harness(cap=3)
        await h.publish(2)
        waiter = asyncio.ensure_future(h.admission.admit(3))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        assert h.ae.num_queued == 3 == h.gauge()  # 2 in the engine + 1 place held
        for size in (1, 2):  # while one reservation is pending nothing else waits
            with pytest.raises(Refused) as e:
                await h.admission.admit(size)
            assert _claimed(e.value.message) == 3 and "places held" in e.value.message
        await h.publish(1)  # one started running: its place goes to the reservation
        assert not waiter.done() and h.gauge() == 3
        with pytest.raises(Refused):
            await h.admission.admit(1)
        await h.publish(0)
        ticket = await asyncio.wait_for(waiter, 1)
        assert ticket.remaining == 3 and h.ae.num_queued == 3 == h.gauge()
        ticket.release()
        assert h.gauge() == 0

    asyncio.run(main())


def test_a_release_on_the_loop_goes_to_the_pending_reservation_first():
    async def main() -> None:
        h = Harness(cap=2)
        other = await h.admission.admit(2)
        waiter = asyncio.ensure_future(h.admission.admit(2))
        await asyncio.sleep(0.01)
        other.release()  # e.g. its client left before it was sent
        with pytest.raises(Refused):  # the freed places were already taken
            await h.admission.admit(1)
        assert (await asyncio.wait_for(waiter, 1)).remaining == 2

    asyncio.run(main())


def test_a_pending_reservation_gives_its_places_back_when_it_ends():
    async def main() -> None:
        h = Harness(cap=3, timeout_s=0.3)
        await h.publish(2)
        # Timeout: the usual 503, its count read after the places were given back.
        with pytest.raises(Refused) as e:
            await h.admission.admit(3)
        assert e.value.reason == "queue_full" and "waited 0.3 s" in e.value.message
        assert _claimed(e.value.message) == 2 == h.ae.num_queued == h.gauge()
        # The client hangs up.
        gone = asyncio.Event()
        waiter = asyncio.ensure_future(h.admission.admit(3, gone.wait))
        await asyncio.sleep(0.01)
        assert h.gauge() == 3
        gone.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(waiter, 1)
        assert h.gauge() == 2
        # The shutdown grace period ends.
        h.admission.timeout_s = 30
        waiter = asyncio.ensure_future(h.admission.admit(3))
        await asyncio.sleep(0.01)
        h.ae.fail_all("the server is shutting down")
        with pytest.raises(Refused) as e:
            await asyncio.wait_for(waiter, 1)
        assert e.value.reason == "shutting_down" and h.gauge() == 2

    asyncio.run(main())


def test_without_a_cap_everything_is_admitted_and_counted():
    async def main() -> None:
        h = Harness(cap=None)
        await h.publish(5)
        tickets = [await h.admission.admit(k) for k in (1, 4, 16)]
        assert h.gauge() == 5 + 21
        for t in tickets:
            t.release()
        assert h.gauge() == 5

    asyncio.run(main())


def test_refusals_are_counted_by_reason():
    async def main() -> None:
        h = Harness(cap=1)
        serving = Serving.__new__(Serving)  # only what admission needs
        serving.async_engine, serving.admission, serving.max_waiting_requests = (
            h.ae, h.admission, 1)
        serving._count_rejected = h.metrics.count_rejected
        ticket = await serving.admit(1)
        with pytest.raises(ApiError) as e:
            await serving.admit(1)
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        with pytest.raises(ApiError) as e:
            serving.check_size(1, 2)
        assert e.value.status == 400
        ticket.release()
        h.client.alive = False  # the engine loop ended
        with pytest.raises(ApiError) as e:
            await serving.admit(1)
        assert e.value.status == 503 and "not running" in e.value.message
        h.ae.fail_all("stop")
        with pytest.raises(ApiError):
            await serving.admit(1)
        h.metrics.count_rejected("connection_limit")  # the HTTP layer's own cap
        text = h.metrics.render()[0].decode()
        counts = {r: _scrape(text, "vllm:num_requests_rejected_total", reason=r)
                  for r in REJECT_REASONS}
        assert counts == {"queue_full": 1, "too_many_sequences": 1, "engine_dead": 1,
                          "shutting_down": 1, "connection_limit": 1}

    asyncio.run(main())


# ---- a real server ----------------------------------------------------------------------------

CAP = 3


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    # One running slot: a long filler holds it, so whatever is admitted stays waiting.
    s = RemoteServer("tiny-llama", ["--dtype", "float32", "--max-model-len", "2048",
                                      "--max-num-seqs", "1", "--max-waiting-requests", str(CAP)])
    yield s
    s.close()


def _rejected(m: Any, reason: str) -> float:
    return m.get("vllm:num_requests_rejected_total", reason=reason)


async def _hold_running(c: httpx.AsyncClient, started: asyncio.Event) -> None:
    """A stream far longer than the test; cancelled (a disconnect) when no longer needed."""
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                started.set()


def test_burst_the_gauge_never_reads_below_a_503s_count(server):
    """With the only running slot held, a burst of 4 × the cap: the cap is admitted, each 503
    says how many wait, and /metrics read right after it never shows fewer."""
    before = server.metrics()
    claims: list[tuple[int, float]] = []

    async def one(c: httpx.AsyncClient, i: int) -> int:
        r = await c.post("/v1/completions", json={"prompt": f"Burst {i}", "max_tokens": 2,
                                                  "ignore_eos": True})
        if r.status_code == 503:
            said = _claimed(assert_error(r, 503, "ServiceUnavailableError")["message"])
            gauge = (await c.get("/metrics")).text
            claims.append((said, _scrape(gauge, "vllm:num_requests_waiting")))
        return r.status_code

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT_S,
                                     limits=limits) as c:
            started = asyncio.Event()
            filler = asyncio.create_task(_hold_running(c, started))
            try:
                await asyncio.wait_for(started.wait(), 30)
                burst = [asyncio.create_task(one(c, i)) for i in range(4 * CAP)]
                while len(claims) < 3 * CAP and not all(t.done() for t in burst):
                    await asyncio.sleep(0.02)
                assert not filler.done(), "the filler ended during the burst"
            finally:
                filler.cancel()  # the admitted ones run now
                await asyncio.gather(filler, return_exceptions=True)
            return await asyncio.gather(*burst)

    statuses = asyncio.run(asyncio.wait_for(run(), 60))
    assert sorted(statuses) == [200] * CAP + [503] * (3 * CAP), statuses
    assert len(claims) == 3 * CAP
    for said, gauge in claims:
        assert said == CAP and gauge >= said, claims
    after = server.wait_idle(10)
    assert _rejected(after, "queue_full") - _rejected(before, "queue_full") == 3 * CAP
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": CAP + 1})
    assert_error(r, 400, "BadRequestError", f"--max-waiting-requests {CAP}", param="n")
    m = server.metrics()
    assert _rejected(m, "too_many_sequences") - _rejected(before, "too_many_sequences") == 1
    assert _rejected(m, "engine_dead") == _rejected(m, "shutting_down") == 0


def test_n_equal_to_the_cap_is_not_starved_by_steady_single_requests(server):
    """Background: one small request every 0.3 s throughout. A long stream holds the only
    running slot until the queue is full, so the request of n = cap arrives to a full queue (it
    used to need an empty one: refused at once, and under steady load for ever). It now holds
    the request and takes places as they free, ahead of the background arrivals, and completes
    once the stream is gone and the queue drains."""
    background: list[int] = []

    async def send(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": "Background", "max_tokens": 8,
                                                  "ignore_eos": True})
        background.append(r.status_code)

    async def run() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT_S,
                                     limits=httpx.Limits(max_connections=64)) as c:
            started = asyncio.Event()
            filler = asyncio.create_task(_hold_running(c, started))
            stop = asyncio.Event()
            sent: list[asyncio.Task[None]] = []

            async def load() -> None:
                while not stop.is_set():
                    sent.append(asyncio.create_task(send(c)))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.3)

            loader = asyncio.create_task(load())
            try:
                await asyncio.wait_for(started.wait(), 30)
                while (await asyncio.to_thread(server.metrics)).waiting < CAP:
                    await asyncio.sleep(0.05)
                t0 = time.monotonic()
                big = asyncio.create_task(c.post("/v1/completions", json={
                    "prompt": "Tell me", "max_tokens": 4, "n": CAP, "ignore_eos": True}))
                await asyncio.sleep(1.0)  # background arrivals keep coming meanwhile
                assert not big.done(), big.result().text  # held, not refused
                assert (await asyncio.to_thread(server.metrics)).waiting == CAP
                filler.cancel()
                r = await big
                return r, time.monotonic() - t0
            finally:
                filler.cancel()
                stop.set()
                await asyncio.gather(filler, loader, return_exceptions=True)
                await asyncio.gather(*sent, return_exceptions=True)

    r, waited = asyncio.run(asyncio.wait_for(run(), 90))
    assert r.status_code == 200, (r.text, waited)
    assert [c["index"] for c in r.json()["choices"]] == list(range(CAP))
    assert 200 in background and 503 in background, background
    assert set(background) <= {200, 503}, background
    server.wait_idle(10)
