"""One thread for every tensor computation of a process that runs its engine off the main thread.

PyTorch's CPU kernels run their parallel regions on OpenMP, and libgomp gives each thread that
opens a parallel region a worker pool of its own. A server that loads the model on its main
thread and steps the engine on another has two pools; once the pools' threads outnumber the
cores, libgomp throttles its workers' spin-waiting to almost nothing, so each of the ~1,000
parallel regions of a decode step pays a sleep and a wake-up. Measured on 2 cores (AMD EPYC,
SmolLM2 int8, docs/performance.md): a B=1 decode step took 22-27 ms when stepped from a second
thread against 11-13 ms on the thread that had loaded the model. Building the engine and
running its loop on this one thread keeps a single pool.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "chunkserve-engine") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the thread and waits for it (e.g. building the engine)."""
        return self._pool.submit(fn).result()

    def start(self, fn: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Runs `fn` on the thread without waiting (the engine loop)."""
        return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
