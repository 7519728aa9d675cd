"""The simulator's `Executor`: a cost model in place of the model.

Each step advances a virtual clock by the cost model's predicted duration and "samples" a
placeholder token for every request that catches up. The engine loop around it — scheduler,
stop rules (requests ignore EOS and run to max_tokens, as the benchmark's do), per-request
metrics, step records — is `LLMEngine`'s own.
"""
from __future__ import annotations

from chunkserve.core.kv_groups import KVCacheGroups, single_group
from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.engine.clock import VirtualClock
from chunkserve.engine.executor import RunnerOutput
from chunkserve.sim.cost_model import CostModel, StepShape, step_time

PLACEHOLDER_TOKEN = 0  # simulated requests ignore EOS, so the sampled id never matters


class CostModelExecutor:
    def __init__(self, cost_model: CostModel, clock: VirtualClock, num_kv_blocks: int,
                 num_swap_blocks: int = 0, kv_cache_groups: KVCacheGroups | None = None) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.num_kv_blocks = num_kv_blocks  # a pool of block ids only: no memory behind it
        self.num_swap_blocks = num_swap_blocks
        # A block id is a page of `group_size` layers; one group unless sliding windows.
        self.kv_cache_groups = kv_cache_groups or single_group(1)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.clock.advance(step_time(self.cost_model, StepShape.from_output(scheduler_output)))
        return RunnerOutput({s.request.request_id: PLACEHOLDER_TOKEN
                             for s in scheduler_output.scheduled if s.samples})

    def commit_kv_memory(self) -> None:
        pass  # nothing is allocated

    def close(self) -> None:
        pass
