"""The engine loop in its own thread, fed by a thread-safe queue from the HTTP event loop.

The HTTP side never touches the engine's state: it sends `add`/`abort` commands and receives
each request's `RequestOutput`s on an asyncio queue of its own. The engine thread drains the
commands, runs one `step()`, hands the outputs back with `call_soon_threadsafe`, and sleeps on
the command queue when there is nothing to run, so an idle server burns no CPU.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from chunkserve.serve.compute_thread import ComputeThread
from chunkserve.engine.llm_engine import LLMEngine, StepError
from chunkserve.engine.processor import EngineRequest
from chunkserve.outputs import RequestOutput
from chunkserve.serve.metrics import ServerMetrics

log = logging.getLogger("chunkserve.engine")


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine failed while running this request; the engine itself carries on."""


class ShuttingDownError(EngineDeadError):
    """The server is stopping and its grace period for in-flight requests is over."""


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


@dataclass
class _Add:
    request: EngineRequest
    sink: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    reason: str


@dataclass
class _ResetPrefixCache:
    # Answered from the engine thread: the cache may only change between steps.
    done: concurrent.futures.Future[int]


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 compute: ComputeThread | None = None) -> None:
        """`compute`: the thread that built `engine` (the loop then runs there too: one OpenMP
        pool, serve/compute_thread.py); a thread of its own when None."""
        self.engine = engine
        self.metrics = metrics
        self._compute = compute or ComputeThread()
        self._commands: queue.Queue[object] = queue.Queue()
        self._sinks: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._num_tokens: dict[str, int] = {}  # output tokens already reported, per request
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: concurrent.futures.Future[None] | None = None  # the loop, on `_compute`
        # What --max-waiting-requests counts: places reserved by admission, adds sent but not
        # applied, and the engine's waiting queue. The event loop writes the first two, the
        # engine thread `_published`: (adds applied, waiting) from one instant, replaced as one
        # tuple so a reader never pairs a new count with an old one. No lock is needed.
        self._num_reserved = 0
        self._num_sent = 0
        self._num_applied = 0
        self._published = (0, 0)
        # Called on the event loop when the count above may have dropped (a release, or the
        # engine published a change): admission's pending reservation takes the freed places.
        self._on_freed: Callable[[], None] | None = None
        self._closing = False  # the shutdown grace period is over: no new requests
        self._refusal: str | None = None  # the engine thread's copy of the fail_all reason
        self.error: BaseException | None = None
        if metrics is not None:
            # The waiting gauge is this count, read at every scrape (on the event loop, where
            # the counts it adds up are written): exactly what admission compares with the cap.
            metrics.track_waiting(lambda: self.num_queued)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = self._compute.start(self._run)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is still in flight and stops the engine thread."""
        if self._running is None:
            return
        self._commands.put(_STOP)
        concurrent.futures.wait([self._running], timeout)
        self._running = None
        self._compute.shutdown()
        self.engine.close()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._running is not None and not self._running.done()

    @property
    def closing(self) -> bool:
        """The shutdown grace period is over: new requests are refused."""
        return self._closing

    @property
    def num_waiting(self) -> int:
        """The engine's waiting queue as of its last step."""
        return self._published[1]

    @property
    def num_queued(self) -> int:
        """Requests not yet running: what --max-waiting-requests limits, and what the gauge
        vllm:num_requests_waiting shows. Places reserved by admission (a pending reservation's
        included), adds not yet applied, and the engine's waiting queue. Never an undercount:
        a request the engine has started still counts until the engine's next publish."""
        applied, waiting = self._published
        return self._num_reserved + self._num_sent - applied + waiting

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
        the error, so a stream can still end with an error event. The engine thread does the
        aborting, after the step in progress, so every output delivered before it (finished
        work included) reaches its consumer first.
        """
        self._closing = True
        self._commands.put(_FailAll(reason))
        self._places_freed()  # a reservation waiting for places gives up now

    # ---- the HTTP side ----------------------------------------------------------------------
    async def generate(
        self, request: EngineRequest, ticket: Ticket | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes; aborts it if the caller goes away.

        `request` comes from the engine's Processor, already validated: the engine thread can
        then only refuse a duplicate id. `ticket` holds the queue place admission reserved.
        """
        request_id = request.request_id
        if ticket is not None:
            ticket.take()
        if self._closing:
            raise ShuttingDownError("the server is shutting down")
        if not self.is_healthy:
            raise EngineDeadError("the engine is not running")
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._sinks[request_id] = sink
        self._num_sent += 1
        self._commands.put(_Add(request, sink))
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._sinks.pop(request_id, None)
            if not finished:  # cancelled, disconnected or the consumer stopped early
                self._commands.put(_Abort(request_id))

    async def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (POST /reset_prefix_cache), between two steps."""
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._commands.put(_ResetPrefixCache(done))
        return await asyncio.wrap_future(done)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block=idle):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_state()
        except BaseException as e:  # a bug in the loop itself: fail everyone, report unhealthy
            log.exception("engine loop died")
            self.error = e
            for rid in list(self._sinks):
                self._deliver(rid, EngineDeadError(f"the engine loop died: {e!r}"))
        finally:
            self._fail_all(lambda: EngineDeadError("the server is shutting down"))

    def _drain_commands(self, block: bool) -> bool:
        """Applies all queued commands; returns False when asked to stop."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: object) -> None:
        if isinstance(cmd, _Add):
            self._num_applied += 1
            rid = cmd.request.request_id
            if rid not in self._sinks:  # aborted before it reached the engine
                return
            if self._refusal is not None:  # sent just before fail_all
                self._deliver(rid, ShuttingDownError(self._refusal))
                return
            try:
                self.engine.add_engine_request(cmd.request)
                self._num_tokens[rid] = 0
            except ValueError as e:
                self._deliver(rid, e)
        elif isinstance(cmd, _Abort):
            if cmd.request_id in self._num_tokens:
                self.engine.abort_request(cmd.request_id)
                self._num_tokens.pop(cmd.request_id, None)
                if self.metrics is not None:
                    self.metrics.observe_aborted()
        elif isinstance(cmd, _ResetPrefixCache):
            cmd.done.set_result(self.engine.reset_prefix_cache())
        elif isinstance(cmd, _FailAll):
            self._refusal = cmd.reason
            self._fail_all(lambda: ShuttingDownError(cmd.reason))

    def _step(self) -> None:
        try:
            result = self.engine.step()
        except StepError as e:
            # Contain a failure to the requests of the failed step: fail and drop them, keep
            # serving the rest. (The scheduler already counted their tokens as computed.)
            log.exception("engine step failed")
            self.engine.abort_request(e.request_ids)
            cause = e.__cause__ or e
            for rid in e.request_ids:
                self._num_tokens.pop(rid, None)
                self._deliver(rid, RequestFailedError(
                    f"internal error while generating: {cause!r}"))
            return
        if self.metrics is not None:
            self.metrics.observe_step(result.record)
        for out in result.outputs:
            n = len(out.outputs[0].token_ids)
            new = n - self._num_tokens.get(out.request_id, 0)
            self._num_tokens[out.request_id] = n
            if out.finished:
                self._num_tokens.pop(out.request_id, None)
            if self.metrics is not None:
                self.metrics.observe_output(out, new)
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(sink.put_nowait, item)

    def _publish_state(self) -> None:
        stats = self.engine.stats()
        before, self._published = self._published, (self._num_applied, stats.num_waiting)
        if (self._published != before and self._on_freed is not None
                and self._loop is not None and not self._loop.is_closed()):
            self._loop.call_soon_threadsafe(self._places_freed)
        if self.metrics is not None:
            self.metrics.set_state(stats.num_running, stats.num_waiting, stats.kv_usage,
                                   stats.kv_internal_fragmentation)

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Aborts every request the engine holds; each consumer gets an error of its own."""
        ids = list(self._num_tokens)
        if ids:
            self.engine.abort_request(ids)
        for rid in ids:
            if self.metrics is not None:
                self.metrics.observe_aborted()
            self._deliver(rid, make_error())
        self._num_tokens.clear()
        self._publish_state()
