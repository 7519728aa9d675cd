"""What the engine loop runs a step on: the model, or a stand-in that only keeps time.

`LLMEngine` drives an `Executor` and never looks past this interface, so the real model
(`ModelRunner`) and the simulator's cost model (`sim.cost_executor.CostModelExecutor`) run under
the very same loop: schedule, execute, update, record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from chunkserve.core.kv_groups import KVCacheGroups
from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.outputs import RequestError


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    # request id -> [(sampled token, logprob), *top-k (token, logprob)], only when asked for
    logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # request id -> (i, entries): the prompt-logprob entries of prompt tokens i, i+1, ... that
    # this step's chunk predicted (SamplingParams.prompt_logprobs; see RequestOutput).
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float]]]]] = field(
        default_factory=dict
    )
    # Seconds the sampler spent applying grammar masks to the logits (0 without any): the
    # engine adds it to its own mask-filling time in the step's record.
    grammar_time: float = 0.0
    # request id -> why its row failed while the step ran (engine/sampler.py): it has no token
    # in `sampled`, and the engine ends it alone with this error.
    failed: dict[str, RequestError] = field(default_factory=dict)


class FatalExecutorError(RuntimeError):
    """The executor can run no more steps (a tensor-parallel worker died): the engine loop
    fails every request and stops, instead of failing one step's requests at a time."""


class Executor(Protocol):
    # The KV pool it owns, in blocks of `block_size` tokens: the scheduler allocates within it.
    num_kv_blocks: int
    num_swap_blocks: int
    # Which layers share a block table (one group unless the model mixes sliding-window and
    # full-attention layers): the scheduler keeps one table per group.
    kv_cache_groups: KVCacheGroups

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Runs one step; returns the token of every scheduled request that samples."""
        ...

    def commit_kv_memory(self) -> None:
        """Makes the KV pool resident now rather than page by page while serving."""
        ...

    def close(self) -> None:
        """Releases what it holds beyond memory (worker processes); idempotent."""
        ...
