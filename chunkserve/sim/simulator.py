"""Discrete-event simulation: `LLMEngine` on a virtual clock, a cost model for the model.

The engine is the real one (scheduler, KV cache manager, metrics, step records); only its
executor differs (`CostModelExecutor`). The workload is replayed by the same loop as
`bench sweep`'s, so a simulated run and a measured one differ only in what executes a step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chunkserve.benchlib.replay import replay
from chunkserve.benchlib.sweep import RunResult, SweepPoint
from chunkserve.benchlib.workloads import BenchRequest
from chunkserve.config import EngineConfig
from chunkserve.core.chunk_budget import StepTimeFn
from chunkserve.core.kv_groups import KVCacheGroups
from chunkserve.engine.clock import VirtualClock
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.processor import Processor
from chunkserve.sim.cost_executor import CostModelExecutor
from chunkserve.sim.cost_model import CostModel, ScaledCostModel, planned_step_time


@dataclass(frozen=True)
class SimConfig:
    max_model_len: int
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0
    enable_prefix_caching: bool = True
    # The model's KV-cache groups (sliding-window layers free blocks); None: one group.
    kv_cache_groups: KVCacheGroups | None = None


def sim_engine(point: SweepPoint, config: SimConfig, cost_model: CostModel,
               clock: VirtualClock, planner: CostModel | StepTimeFn | None = None
               ) -> LLMEngine:
    """The engine of one simulated configuration; `clock` is what its steps advance. The
    adaptive policy sizes chunks with `planner` (default: the cost model that times the steps;
    another one simulates a machine whose speed differs from the model the engine plans with;
    a step-time callable is planned with as it is: a warm `OnlineCostModel` learns from the
    simulated steps as it would from real ones)."""
    if not callable(planner):  # a cost model (or none): plan with its predictions
        planner = planned_step_time(planner or cost_model)
    engine_config = EngineConfig.from_kwargs(
        max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
        preemption_mode=config.preemption_mode,
        enable_prefix_caching=config.enable_prefix_caching, **point.engine_kwargs(),
        **({"step_time": planner} if point.adaptive else {}),
    ).resolve(config.max_model_len)
    executor = CostModelExecutor(cost_model, clock, config.num_kv_blocks, config.num_swap_blocks,
                                 config.kv_cache_groups)
    # No tokenizer (outputs carry no text) and no vocabulary check (placeholder tokens).
    processor = Processor(config.max_model_len, vocab_size=None)
    return LLMEngine(engine_config, executor, processor, clock.time)


@dataclass
class Workbench:
    """A workload ready to simulate: what every configuration of a sweep or a search runs on
    (the same requests at the same arrival times)."""

    config: SimConfig
    cost: CostModel
    requests: Sequence[BenchRequest]
    arrivals: Sequence[float]
    # req/s of the arrivals (inf: all at once); several: a load that steps, one rate for each
    # equal part of the requests (workloads.stepped_arrival_times)
    rate: float | tuple[float, ...]

    def run(self, point: SweepPoint, slowdown: float = 1.0) -> RunResult:
        """One configuration; `slowdown` > 1 runs it on a machine that many times slower than
        the cost model, whose adaptive policy still plans with the model (as a real engine
        planning with a stale profile would). `auto` plans with the slower machine's model:
        the engine's online model learns the machine it runs on."""
        cost = self.cost if slowdown == 1.0 else ScaledCostModel(self.cost, slowdown)
        planner = cost if point.auto else self.cost
        return simulate(point, self.config, cost, self.requests, self.arrivals, planner)


def simulate(
    point: SweepPoint,
    config: SimConfig,
    cost_model: CostModel,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    planner: CostModel | StepTimeFn | None = None,
) -> RunResult:
    """Replays the workload on the virtual clock; the same shape of result as a real sweep."""
    clock = VirtualClock()
    engine = sim_engine(point, config, cost_model, clock, planner)
    return replay(engine, point, requests, arrivals, clock)
