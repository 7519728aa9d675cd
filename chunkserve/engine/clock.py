"""The engine's time: the wall clock for a real engine, a virtual one for the simulator.

A replay asks a clock for the time and to wait for the next arrival; the wall clock sleeps,
the virtual clock jumps. The cost-model executor advances the virtual clock by each step's
predicted duration, so the engine measures simulated steps exactly as it measures real ones.
"""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class WallClock:
    def time(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.time()))


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep_until(self, t: float) -> None:
        self.now = max(self.now, t)
