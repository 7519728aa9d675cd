"""The server's engines as the HTTP event loop sees them: requests in, outputs out, by queue.

The HTTP side never touches an engine's state. It sends commands (engine/engine_loop.py) to an
engine's loop through that engine's client (frontend/engine_client.py): one loop on the compute
thread, or, under `--data-parallel-size N`, N engine processes (frontend/engines.py), each
request routed by `DPRouter` (frontend/dp_router.py). Each loop's events come back to `_handle`,
which runs on whatever thread delivered them: it hands each event to the observers (the
server's metrics and step stream, which are thread-safe), and each request's outputs to its
asyncio queue with `call_soon_threadsafe`; the bookkeeping that admission and the router read
is updated on the event loop itself.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from chunkserve.engine.processor import EngineRequest, Processor
from chunkserve.outputs import RequestOutput
from chunkserve.frontend.broadcast import Broadcast
from chunkserve.engine.compute_thread import ComputeThread
from chunkserve.frontend.dp_router import DPRouter
from chunkserve.frontend.engine_client import EngineClient, EngineInfo, InProcessClient
from chunkserve.engine.engine_loop import (
    Abort,
    Add,
    EngineDeadError,
    FailAll,
    LoopError,
    LoopEvent,
    RequestFailedError,
    ResetPrefixCache,
    ShuttingDownError,
    StartProfile,
    StopProfile,
)

if TYPE_CHECKING:
    from chunkserve.engine.llm_engine import LLMEngine

log = logging.getLogger("chunkserve.engine")
__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError", "ShuttingDownError", "Ticket"]


class EngineObserver(Protocol):
    """Sees every engine's events as they arrive, on whatever thread delivers them (the
    server's metrics and the web page's step stream: serve/metrics.py, serve/step_stream.py).
    Injected, so the front end knows nothing of what watches it."""

    def on_event(self, index: int, ev: LoopEvent) -> None: ...


class Ticket:
    """Queue places reserved at admission, held until each sub-request is sent to the engine.

    Checking the waiting count and counting the new request must happen with no `await` in
    between, or simultaneous arrivals all pass the check (the cap was overshot that way). The
    reservation is taken at the check; `generate` turns one place into a sent request, and
    `release` gives back what was never sent (a disconnect or an error before sending). `grow`
    adds places to a reservation that is still gathering them (serve/admission.py).
    """

    def __init__(self, engine: AsyncEngine, num: int) -> None:
        self._engine = engine
        self.remaining = num
        engine._num_reserved += num

    def take(self) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            self._engine._num_reserved -= 1

    def grow(self, num: int) -> None:
        self.remaining += num
        self._engine._num_reserved += num

    def release(self) -> None:
        freed = self.remaining
        self._engine._num_reserved -= freed
        self.remaining = 0
        if freed:
            self._engine._places_freed()


class _EngineCounts:
    """One engine's queue as the event loop knows it: requests sent to it, and (from its last
    event, replaced as one tuple so a reader never pairs a new count with an old one) how many
    of them it had applied, its waiting queue and its running batch."""

    def __init__(self) -> None:
        self.sent = 0
        self.published = (0, 0, 0)  # (applied, waiting, running)

    @property
    def queued(self) -> int:
        """Sent and not yet running: never an undercount, since a request the engine has
        started still counts until its next event."""
        applied, waiting, _ = self.published
        return self.sent - applied + waiting


class AsyncEngine:
    def __init__(self, engines: LLMEngine | Sequence[EngineClient],
                 observers: Sequence[EngineObserver] = (), compute: ComputeThread | None = None,
                 router: DPRouter | None = None) -> None:
        """`engines`: one LLMEngine, run on `compute` (the thread that built it; a thread of
        its own when None), or the clients of several engines, which `router` chooses among
        (a DPRouter over their block size when None). `observers` see every event."""
        if isinstance(engines, Sequence):
            self.clients = list(engines)
        else:
            self.clients = [InProcessClient(engines, compute)]
        self.info: EngineInfo = self.clients[0].info
        self.processor: Processor = self.info.processor
        self.observers = list(observers)
        self.router = router
        if router is None and len(self.clients) > 1:
            self.router = DPRouter(len(self.clients), self.info.block_size)
        self._sinks: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._engine_of: dict[str, int] = {}  # in-flight request id -> its engine's index
        self._counts = [_EngineCounts() for _ in self.clients]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        # What --max-waiting-requests counts: places reserved by admission, plus every
        # engine's queue (_EngineCounts). Written on the event loop only; no lock is needed.
        self._num_reserved = 0
        # Called on the event loop when the count above may have dropped (a release, or an
        # engine published a change): admission's pending reservation takes the freed places.
        self._on_freed: Callable[[], None] | None = None
        # Called (on any thread) once, when an engine dies: the launcher stops the server.
        self.on_fatal: Callable[[], None] | None = None
        self._closing = False  # the shutdown grace period is over: no new requests
        self._resets: Broadcast[int] = Broadcast(self.clients)
        self._profiles: Broadcast[LoopError | None] = Broadcast(self.clients)
        self.error: str | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = True
        for client in self.clients:
            client.start(self._handle)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is still in flight and stops every engine."""
        for client in self.clients:
            client.shutdown(timeout)

    @property
    def is_healthy(self) -> bool:
        return (self.error is None and self._started
                and all(c.is_alive() for c in self.clients))

    @property
    def closing(self) -> bool:
        """The shutdown grace period is over: new requests are refused."""
        return self._closing

    @property
    def num_waiting(self) -> int:
        """The engines' waiting queues as of their last steps."""
        return sum(c.published[1] for c in self._counts)

    @property
    def num_queued(self) -> int:
        """Requests not yet running: what --max-waiting-requests limits. Places reserved by
        admission (a pending reservation's included) and every engine's queue."""
        return self._num_reserved + sum(c.queued for c in self._counts)

    def gauge_queued(self, index: int) -> int:
        """Engine `index`'s waiting gauge: its queue, read at every scrape on the event loop
        (where the counts it adds up are written). With one engine it is exactly what
        admission compares with the cap; with several, reserved places belong to none."""
        extra = self._num_reserved if len(self._counts) == 1 else 0
        return self._counts[index].queued + extra

    def reserve(self, num: int) -> Ticket:
        return Ticket(self, num)

    def watch_freed(self, callback: Callable[[], None] | None) -> None:
        """`callback` runs on the event loop whenever `num_queued` may have dropped (None: stop).
        One watcher at a time: admission's pending reservation (serve/admission.py)."""
        self._on_freed = callback

    def _places_freed(self) -> None:
        callback = self._on_freed
        if callback is not None:
            callback()

    def fail_all(self, reason: str) -> None:
        """Aborts every in-flight request with a ShuttingDownError and refuses new ones.

        The end of the shutdown grace period (called on the event loop): each consumer raises
        the error, so a stream can still end with an error event. The engine loops do the
        aborting, after the step in progress, so every output delivered before it (finished
        work included) reaches its consumer first.
        """
        self._closing = True
        for client in self.clients:
            client.send(FailAll(reason))
        self._places_freed()  # a reservation waiting for places gives up now

    # ---- the HTTP side ----------------------------------------------------------------------
    async def generate(
        self, request: EngineRequest, ticket: Ticket | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes; aborts it if the caller goes away.

        `request` comes from the engine's Processor, already validated: the engine loop can
        then only refuse a duplicate id. `ticket` holds the queue place admission reserved.
        """
        request_id = request.request_id
        if ticket is not None:
            ticket.take()
        if self._closing:
            raise ShuttingDownError("the server is shutting down")
        if not self.is_healthy:
            raise EngineDeadError("the engine is not running")
        index = self.router.route(request.prompt_token_ids) if self.router is not None else 0
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._sinks[request_id] = sink
        self._engine_of[request_id] = index
        self._counts[index].sent += 1
        client = self.clients[index]
        client.send(Add(request))
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:  # this request failed alone (LLMEngine.step)
                    raise RequestFailedError(item.error.message,
                                             400 if item.error.client_error else 500)
                yield item
        finally:
            self._sinks.pop(request_id, None)
            self._engine_of.pop(request_id, None)
            if not finished:  # cancelled, disconnected or the consumer stopped early
                client.send(Abort(request_id))

    async def reset_prefix_cache(self) -> int:
        """Forgets every engine's cached prefixes (POST /reset_prefix_cache), between steps;
        the sum of their answers."""
        assert self._loop is not None, "start() first"
        return sum(await self._resets.ask(ResetPrefixCache))

    async def start_profile(self) -> None:
        """Starts every engine's profiler, each on its own loop (POST /start_profile); raises
        an engine's refusal (engine/profiler.py's ProfilerStateError: one already runs)."""
        await self._profile(StartProfile)

    async def stop_profile(self) -> None:
        """Stops every engine's profiler; each writes its trace before answering."""
        await self._profile(StopProfile)

    async def _profile(self, command: type[StartProfile] | type[StopProfile]) -> None:
        assert self._loop is not None, "start() first"
        errors = [e for e in await self._profiles.ask(command) if e is not None]
        if errors:
            raise errors[0].exception()

    # ---- events from the engine loops (any thread) ------------------------------------------
    def _handle(self, index: int, ev: LoopEvent) -> None:
        for observer in self.observers:
            observer.on_event(index, ev)
        self._call_soon(self._apply_event, index, ev)
        if ev.fatal is not None:
            self.engine_died(index, ev.fatal)

    def engine_died(self, index: int, reason: str) -> None:
        """Engine `index` can serve no more (its loop died, or its process exited): its
        requests fail, /health turns 503, and `on_fatal` tells the launcher to stop. Any
        thread."""
        if self.error is None:
            self.error = f"engine {index} died: {reason}"
            log.error("%s", self.error)
        self._call_soon(self._fail_engine, index)
        if self.on_fatal is not None:
            self.on_fatal()

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between: nobody is listening
                pass

    # ---- on the event loop -------------------------------------------------------------------
    def _apply_event(self, index: int, ev: LoopEvent) -> None:
        for rid, item, _ in ev.outputs:
            sink = self._sinks.get(rid)
            if sink is not None:
                sink.put_nowait(item)
        for rid, error in ev.errors:
            sink = self._sinks.get(rid)
            if sink is not None:
                sink.put_nowait(error.exception())
        for token, result in ev.reset_answers:
            self._resets.answer(token, result)
        for token, error in ev.profile_answers:
            self._profiles.answer(token, error)
        if ev.stats is not None:
            self._publish(index, ev.num_applied, ev.stats.num_waiting, ev.stats.num_running)

    def _publish(self, index: int, applied: int, waiting: int, running: int) -> None:
        """An engine's counts after a pass of its loop: admission's and the router's view."""
        counts = self._counts[index]
        before, counts.published = counts.published, (applied, waiting, running)
        if self.router is not None:
            self.router.update(index, counts.queued, running)
        if counts.published[:2] != before[:2]:
            self._places_freed()

    def _fail_engine(self, index: int) -> None:
        """Fails what is still in flight on a dead engine (its loop may not have been able
        to), and whatever waits for an answer from it."""
        error = EngineDeadError(self.error or f"engine {index} died")
        for rid, engine in list(self._engine_of.items()):
            sink = self._sinks.get(rid)
            if engine == index and sink is not None:
                sink.put_nowait(error)
        self._resets.fail(error)
        self._profiles.fail(error)
        self._places_freed()  # a pending reservation gives up now
