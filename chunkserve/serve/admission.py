"""Admission against --max-waiting-requests: who gets a queue place, who waits, who gets a 503.

The count is `AsyncEngine.num_queued`: every admitted request not yet running (places reserved
here, requests on their way to the engine thread, the scheduler's waiting queue). The 503
message and the gauge `vllm:num_requests_waiting` read that same count.

The rule, for a request of k sequences (n × prompts) against a cap C:

- it is admitted at once when the queue has room for all of it (waiting + k <= C);
- k = 1 never waits: it is admitted or refused at once (503 + Retry-After);
- k > 1 that does not fit (k <= C: bigger ones were refused with a 400 by `check_size`) takes
  the places that are free now and waits for the rest, holding its HTTP request, unless another
  such reservation is already pending (then 503). While one is pending, every place that frees
  goes to it first, so arrivals that do not fit are refused as usual and steady single requests
  cannot starve it. Its places count as waiting (gauge and 503 messages).
- The wait ends with the places (admitted), or after `timeout_s` (RESERVATION_TIMEOUT_S, 30 s:
  a 503 like any other), or when the client disconnects, the shutdown grace period ends or the
  engine dies; every place held is given back then.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from chunkserve.frontend.async_engine import AsyncEngine, Ticket

RESERVATION_TIMEOUT_S = 30.0
# A pending reservation is woken whenever places may have freed; it also looks again this often,
# so a missed wake-up (or an engine that died silently) costs at most this long.
_RECHECK_S = 0.5


class Refused(Exception):
    """Not admitted: `reason` is the label of vllm:num_requests_rejected_total."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class ClientGone(Exception):
    """The client disconnected while its request waited for queue places."""


class _Pending:
    def __init__(self, ticket: Ticket, need: int) -> None:
        self.ticket = ticket
        self.need = need
        self.changed = asyncio.Event()


class Admission:
    def __init__(self, engine: AsyncEngine, limit: int | None,
                 timeout_s: float = RESERVATION_TIMEOUT_S) -> None:
        self.engine = engine
        self.limit = limit
        self.timeout_s = timeout_s
        self._pending: _Pending | None = None

    def overloaded(self, detail: str = "") -> Refused:
        """The 503 of a full queue; its count is read now, after any places were given back."""
        queued = self.engine.num_queued
        pending = self._pending
        held = (f", {pending.ticket.remaining} of them places held for a request of "
                f"{pending.need} sequences" if pending is not None and pending.ticket.remaining
                else "")
        return Refused("queue_full",
                       f"The server is overloaded: {queued} requests are waiting{held} "
                       f"(--max-waiting-requests {self.limit}).{detail} Retry later.")

    async def admit(self, num: int,
                    disconnected: Callable[[], Awaitable[None]] | None = None) -> Ticket:
        """Queue places for `num` sub-requests, or Refused / ClientGone.

        The check and the reservation happen with no await in between (simultaneous arrivals
        cannot all pass the check); only a pending reservation awaits, and then `disconnected()`
        (returns when the client hangs up) ends the wait early.
        """
        self._check_running()
        self._settle()  # places freed since the last look belong to a pending reservation
        limit = self.limit
        queued = self.engine.num_queued
        if limit is None or queued + num <= limit:
            return self.engine.reserve(num)
        if num == 1 or num > limit or self._pending is not None:
            raise self.overloaded()
        return await self._wait_for_places(num, max(0, limit - queued), disconnected)

    # ---- the pending reservation ----------------------------------------------------------
    def _check_running(self) -> None:
        if self.engine.closing:
            raise Refused("shutting_down", "The server is shutting down.")
        if not self.engine.is_healthy:
            raise Refused("engine_dead", "The engine is not running.")

    def _settle(self) -> None:
        """Gives the pending reservation what is free (on the event loop, synchronously)."""
        pending = self._pending
        if pending is None or self.limit is None:
            return
        missing = pending.need - pending.ticket.remaining
        free = self.limit - self.engine.num_queued
        if missing > 0 and free > 0:
            pending.ticket.grow(min(missing, free))
        if (pending.ticket.remaining >= pending.need or self.engine.closing
                or not self.engine.is_healthy):
            pending.changed.set()

    async def _wait_for_places(self, need: int, free: int,
                               disconnected: Callable[[], Awaitable[None]] | None) -> Ticket:
        pending = self._pending = _Pending(self.engine.reserve(free), need)
        self.engine.watch_freed(self._settle)
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        granted = False
        try:
            while True:
                self._settle()
                if pending.ticket.remaining >= need:
                    granted = True
                    return pending.ticket
                self._check_running()
                left = deadline - loop.time()
                if left <= 0:
                    break
                pending.changed.clear()
                changed = asyncio.ensure_future(pending.changed.wait())
                waits = {changed} if watcher is None else {changed, watcher}
                try:
                    await asyncio.wait(waits, timeout=min(left, _RECHECK_S),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if watcher is not None and watcher.done():
                    raise ClientGone()
        finally:
            # Stop taking places first, then give back what was taken (unless admitted).
            self._pending = None
            self.engine.watch_freed(None)
            if watcher is not None:
                watcher.cancel()
            if not granted:
                pending.ticket.release()
        raise self.overloaded(f" A request of {need} sequences waited {self.timeout_s:g} s "
                              "for places to free.")
