"""The adaptive chunk policy: size each step's prefill chunk from a step-time model.

A static `max_num_batched_tokens` is one number for every step, but what a step *costs* depends
on its decodes and on how much context the chunk attends to. The adaptive policy asks a
step-time model, every step, for the largest prefill chunk that keeps the predicted step time
at or below `target_itl_ms` (a decoding request's token gap is the duration of the step it is
in), never below `min_chunk_tokens` so prefill always progresses, never above the static cap.

The model arrives as a plain callable so that this module stays pure (no clock, no torch, no
import of the simulator): the engine and the simulator build it from their cost models
(`chunkserve.sim.cost_model.planned_step_time`). Its input, `PlannedStep`, is defined here
rather than reusing the simulator's `StepShape` because core/ must not import sim/, and because
a step being planned is not a list of scheduled requests yet: only the four aggregates the
scheduler knows before choosing are in it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from chunkserve.core.sched_output import ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedStep:
    num_decodes: int
    decode_context: int  # Σ KV length the decodes attend to
    num_prefill_tokens: int
    prefill_context: int  # tokens cached before the chunk (of the prefill that goes first)


StepTimeFn = Callable[[PlannedStep], float]  # seconds

# One measured step: what it ran and how long it took (seconds).
StepObservation = tuple[Sequence[ScheduledRequest], float]


@dataclass(frozen=True)
class StepModelState:
    """What a learning step-time model says after seeing a step (the trace and /metrics)."""

    predicted: float  # seconds: its prediction for the step just seen, made before seeing it
    error: float  # median relative error |predicted - measured| / measured of recent steps
    coefficients: dict[str, float] | None  # the new fit on the steps that refit, else None


@runtime_checkable
class LearnedStepTime(Protocol):
    """A step-time model that learns from the steps the engine runs (the engine's side of the
    seam; sim/online_model.py is the implementation). The engine warm-starts it once, with the
    model loaded, then shows it every step."""

    def __call__(self, step: PlannedStep) -> float: ...

    def warm_start(self, identity: dict[str, str],
                   probe: Callable[[], list[StepObservation]]) -> str:
        """Ready to predict: from a cache keyed by `identity` (machine, model, dtype,
        quantization, ...) or by running `probe`. Says which, for the log."""
        ...

    def observe(self, scheduled: Sequence[ScheduledRequest], duration: float) -> StepModelState:
        ...


def one_decode_step(step_time: StepTimeFn) -> float:
    """The cheapest step there is: one decode at context 1. No target can be below it."""
    return step_time(PlannedStep(1, 1, 0, 0))


def check_target(step_time: StepTimeFn, target_s: float) -> None:
    floor = one_decode_step(step_time)
    if target_s < floor:
        raise ValueError(
            f"target_itl_ms {target_s * 1e3:g} is below the predicted time of a single decode "
            f"step ({floor * 1e3:.2f} ms): no step could meet it. Raise --target-itl-ms."
        )


def adaptive_prefill_tokens(
    step_time: StepTimeFn,
    target_s: float,
    num_decodes: int,
    decode_context: int,
    prefill_context: int,
    min_tokens: int,
    room: int,
) -> int:
    """The largest chunk in [min_tokens, room] predicted to fit target_s (min_tokens if none does).

    `room` is what the static cap leaves after the decodes; a chunk never exceeds it, even when
    that is below the floor (the cap is a hard limit, the floor a preference). Binary search:
    every cost model here is non-decreasing in the chunk's tokens.
    """
    if room <= min_tokens:
        return max(room, 0)

    def fits(n: int) -> bool:
        return step_time(PlannedStep(num_decodes, decode_context, n, prefill_context)) <= target_s

    if fits(room):
        return room
    if not fits(min_tokens):
        return min_tokens
    lo, hi = min_tokens, room  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


class ChunkPlanner:
    """The adaptive policy as the scheduler runs it: a step-time model, a target, a floor.

    An explicit target the cheapest step cannot meet is the user's error (check_target). The
    default target is not: on a machine too slow for it the planner says so once in the log
    and runs prefill at the floor, `min_tokens` a step. The same warning comes, once, when a
    decode batch alone grows past the target while serving.
    """

    def __init__(self, step_time: StepTimeFn, target_s: float, min_tokens: int,
                 explicit_target: bool) -> None:
        self.step_time, self.target_s, self.min_tokens = step_time, target_s, min_tokens
        self._warned = False
        if explicit_target:
            check_target(step_time, target_s)
        elif one_decode_step(step_time) > target_s:
            self._warn(1, one_decode_step(step_time))

    def prefill_tokens(self, num_decodes: int, decode_context: int, prefill_context: int,
                       room: int) -> int:
        """This step's prefill chunk (adaptive_prefill_tokens), warning once at the floor."""
        chunk = adaptive_prefill_tokens(self.step_time, self.target_s, num_decodes,
                                        decode_context, prefill_context, self.min_tokens, room)
        if chunk <= self.min_tokens and not self._warned and num_decodes:
            decodes_only = self.step_time(PlannedStep(num_decodes, decode_context, 0, 0))
            if decodes_only > self.target_s:
                self._warn(num_decodes, decodes_only)
        return chunk

    def _warn(self, num_decodes: int, predicted: float) -> None:
        self._warned = True
        logger.warning(
            "a decode-only step of %d request(s) is predicted to take %.2f ms, above the "
            "token-gap target of %.2f ms: prefill runs at the smallest chunk (%d tokens) while "
            "that lasts. Raise --target-itl-ms to trade token gaps for time to first token.",
            num_decodes, predicted * 1e3, self.target_s * 1e3, self.min_tokens)
