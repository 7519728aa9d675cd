"""Commands sent to every engine and answered by each: POST /reset_prefix_cache, the profiler's.

The caller awaits one future for all the answers. Each command carries a token that its
answer echoes (engine/engine_loop.py's LoopEvent), so answers to different calls never mix, and
an engine that dies fails whatever still waits on it rather than leaving it hanging.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from chunkserve.frontend.engine_client import EngineClient

T = TypeVar("T")


class Broadcast(Generic[T]):
    """One kind of command; `ask` and `answer` run on the event loop."""

    def __init__(self, clients: Sequence[EngineClient]) -> None:
        self._clients = clients
        self._waiting: dict[int, tuple[asyncio.Future[list[T]], list[T]]] = {}
        self._tokens = itertools.count()

    async def ask(self, command: Callable[[int], object]) -> list[T]:
        """Sends `command(token)` to every engine; their answers, in the order they came."""
        token = next(self._tokens)
        done: asyncio.Future[list[T]] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (done, [])
        for client in self._clients:
            client.send(command(token))
        return await done

    def answer(self, token: int, result: T) -> None:
        entry = self._waiting.get(token)
        if entry is None:
            return
        done, answers = entry
        answers.append(result)
        if len(answers) == len(self._clients):
            del self._waiting[token]
            if not done.done():
                done.set_result(answers)

    def fail(self, error: BaseException) -> None:
        """Every call still waiting raises `error` (an engine died: its answer never comes)."""
        waiting, self._waiting = self._waiting, {}
        for done, _ in waiting.values():
            if not done.done():
                done.set_exception(error)
