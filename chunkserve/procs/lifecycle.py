"""Spawning a child, asking whether it lives, and ending it: join, then kill; and a headless
node's one watch over its children (`supervise`).

Every child is started with multiprocessing's `spawn` (a fresh interpreter: no forked
OpenMP or CUDA state) and ended the same way: asked to stop by its owner (a command, a
broadcast), given JOIN_TIMEOUT_S, then killed. One timeout for every kind of child, so a
shutdown's worst case is known.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

log = logging.getLogger("chunkserve.procs")
JOIN_TIMEOUT_S = 10.0  # a child told to stop that has not within this is killed
POLL_S = 0.2  # how often a wait on a child's start-up checks that it still lives


def spawn(target: Callable[..., Any], name: str, args: tuple[Any, ...],
          daemon: bool = False) -> mp.Process:
    """Starts `target(*args)` in a fresh process. Not a daemon by default: a daemon may not
    start children of its own (an engine process starts its tensor-parallel workers)."""
    process = mp.get_context("spawn").Process(target=target, name=name, args=args,
                                              daemon=daemon)
    process.start()
    return process


def join_then_kill(processes: Iterable[mp.Process], timeout: float = JOIN_TIMEOUT_S,
                   terminate: bool = False) -> None:
    """Waits up to `timeout` for each (SIGTERM first with `terminate`); kills any still
    running, with a warning naming it."""
    processes = list(processes)
    if terminate:
        for p in processes:
            if p.is_alive():
                p.terminate()
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.warning("%s did not stop within %g s: killed", p.name, timeout)
            p.kill()
            p.join()


def first_dead(processes: Iterable[mp.Process], timeout: float) -> mp.Process | None:
    """Waits up to `timeout` for any of `processes` to exit; the first one found gone, or
    None. A child's sentinel wakes this at once, with no polling."""
    processes = list(processes)
    wait([p.sentinel for p in processes], timeout)
    return next((p for p in processes if p.exitcode is not None), None)


def exit_reason(process: mp.Process) -> str:
    """How a child ended, for an error message: its exit code, or the signal that killed it."""
    code = process.exitcode
    if code is None:
        return "it is still running"
    if code < 0:
        return f"it was killed by signal {-code}"
    return f"it exited with code {code}"


def _nothing(*_: object) -> None:
    return None


def supervise(children: Sequence[mp.Process], poll_s: float, *, fail_fast: bool,
              on_exit: Callable[[mp.Process], None] = _nothing,
              tick: Callable[[], object] = _nothing,
              on_signal: Callable[[], None] = _nothing) -> int:
    """A headless node's life (engine/tp/headless.py, engine/dp_headless.py): watches its
    children until they end or SIGTERM/SIGINT arrives; the node's exit status.

    Each pass waits up to `poll_s` for a child to die (its sentinel wakes it at once), calls
    `tick` (a beat; what it raises ends the watch, and propagates), then `on_exit` once for
    each child found gone. The status: 1 as soon as a child fails with `fail_fast` (a
    tensor-parallel group is dead with one rank gone), else 1 or 0 once every child has
    exited, by whether any failed; 0 on a signal, after `on_signal`. Whatever ends the watch,
    the children still running are stopped (SIGTERM, then JOIN_TIMEOUT_S, then killed)."""
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    seen: set[int] = set()
    try:
        while not stop.is_set():
            # Every child not yet reported: one that exited before this wait wakes it at once.
            first_dead([p for i, p in enumerate(children) if i not in seen], poll_s)
            tick()
            codes = [p.exitcode for p in children]  # one reading: a child may exit meanwhile
            for i, p in enumerate(children):
                if codes[i] is not None and i not in seen:
                    seen.add(i)
                    on_exit(p)
            failed = any(code not in (None, 0) for code in codes)
            if failed and fail_fast:
                return 1
            if len(seen) == len(children):
                return 1 if failed else 0
        on_signal()
        return 0
    finally:
        join_then_kill(children, terminate=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
