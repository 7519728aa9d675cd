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

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedStep:
    num_decodes: int
    decode_context: int  # Σ KV length the decodes attend to
    num_prefill_tokens: int
    prefill_context: int  # tokens cached before the chunk (of the prefill that goes first)


StepTimeFn = Callable[[PlannedStep], float]  # seconds


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
