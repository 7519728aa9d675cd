"""procs/lifecycle.py's `supervise`, the one watch both headless nodes run (engine/tp/headless.py,
engine/dp_headless.py): its exit status, its hooks, and no child left behind whatever ends it.
The children are bare interpreters (time.sleep, sys.exit), so each starts in a fraction of a
second; the multi-node tests run the real nodes."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from chunkserve.procs.lifecycle import spawn, supervise


def _sleeper(seconds: float = 60.0):  # noqa: ANN202
    return spawn(time.sleep, "sleeper", (seconds,))


def _exiter(code: int):  # noqa: ANN202
    return spawn(sys.exit, f"exits-{code}", (code,))


def test_a_failed_child_ends_a_fail_fast_watch_at_once_and_stops_the_rest() -> None:
    children = [_sleeper(), _exiter(3)]
    exits: list[str] = []
    t0 = time.monotonic()
    status = supervise(children, 5.0, fail_fast=True, on_exit=lambda p: exits.append(p.name))
    assert status == 1 and exits == ["exits-3"]
    assert time.monotonic() - t0 < 4.0  # woken by the sentinel, not the 5 s poll
    assert children[0].exitcode == -signal.SIGTERM  # the sleeper was stopped


def test_without_fail_fast_the_watch_lasts_until_every_child_has_exited() -> None:
    children = [_exiter(0), _exiter(2), spawn(time.sleep, "short", (1.0,))]
    exits: list[str] = []
    ticks: list[int] = []
    status = supervise(children, 0.2, fail_fast=False, on_exit=lambda p: exits.append(p.name),
                       tick=lambda: ticks.append(1))
    assert status == 1 and sorted(exits) == ["exits-0", "exits-2", "short"]
    assert children[2].exitcode == 0 and len(ticks) >= 2
    assert supervise([_exiter(0)], 0.2, fail_fast=False) == 0


def test_a_signal_ends_the_watch_with_0_after_on_signal() -> None:
    children = [_sleeper()]
    said: list[str] = []
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    before = signal.getsignal(signal.SIGTERM)
    status = supervise(children, 0.1, fail_fast=True, on_signal=lambda: said.append("stop"))
    assert status == 0 and said == ["stop"] and children[0].exitcode is not None
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is given back


def test_what_a_tick_raises_ends_the_watch_and_stops_the_children() -> None:
    children = [_sleeper()]

    def lost() -> None:
        raise RuntimeError("the store is gone")

    with pytest.raises(RuntimeError, match="store is gone"):
        supervise(children, 0.1, fail_fast=False, tick=lost)
    assert children[0].exitcode == -signal.SIGTERM
