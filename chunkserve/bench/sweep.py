"""`chunkserve bench sweep`'s runs: one workload, many chunk sizes, the real engine, wall clock.

Every configuration replays the *same* requests at the *same* arrival offsets, in process (no
HTTP, so only scheduling differs), through the replay loop the simulator shares.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chunkserve.benchlib.replay import replay
from chunkserve.benchlib.sweep import RunResult, SweepPoint
from chunkserve.benchlib.workloads import BenchRequest
from chunkserve.engine.clock import WallClock
from chunkserve.engine.llm_engine import LLMEngine, StepResult
from chunkserve.sim.online_model import OnlineCostModel

if TYPE_CHECKING:  # the model (torch) is imported only by a command that loads one
    from chunkserve.model.factory import LoadedModel


def run_point(
    loaded: LoadedModel,
    point: SweepPoint,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    engine_kwargs: dict[str, Any],
    on_step: Callable[[StepResult], None] | None = None,
) -> RunResult:
    clock = WallClock()
    if point.auto:
        # `auto` is what `serve` runs without flags: the engine's own online model, fresh for
        # every run so one point's learning never leaks into another's (its warm start comes
        # from the step-model cache: only the first run on a machine probes).
        engine_kwargs = {**engine_kwargs, "step_time": OnlineCostModel()}
    config_kwargs = dict(model=loaded.path, **engine_kwargs, **point.engine_kwargs())
    engine = LLMEngine.from_kwargs(loaded=loaded, clock=clock.time, **config_kwargs)
    return replay(engine, point, requests, arrivals, clock, on_step)


def measure_capacity(
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    engine_kwargs: dict[str, Any],
    point: SweepPoint,
) -> float:
    """Requests/s the engine sustains on (a sample of) this workload, all arriving at once.

    `--load 0.7` then means 70% of that: busy enough for queues to form, not saturated.
    """
    sample = list(requests[: max(8, len(requests) // 4)])
    run = run_point(loaded, point, sample, [0.0] * len(sample), engine_kwargs)
    return len(sample) / run.duration
