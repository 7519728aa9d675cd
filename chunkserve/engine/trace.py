"""The step trace: one record per engine step, the ground truth for every latency analysis.

The record's fields are a stable contract (docs/trace.md): simulated steps get the same records
(the same engine loop makes them) and the benchmarks read them. Add fields at the end; never
rename or drop one.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import IO

from chunkserve.core.sched_output import SchedulerOutput


@dataclass
class StepRecord:
    step: int
    start: float  # engine clock, seconds
    duration: float  # seconds: schedule + model + sample + bookkeeping
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    num_running: int  # after scheduling
    num_waiting: int
    kv_usage: float  # 0..1
    kv_blocks_used: int
    internal_fragmentation: int  # allocated slots minus stored tokens
    num_preemptions: int  # in this step
    num_swapped_blocks: int  # blocks copied out + in this step
    # Prefix caching (defaults keep older trace files readable). Queries and hits are token
    # counts of the requests admitted this step; the hit rate is cumulative since start.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def step_record(step: int, start: float, duration: float, out: SchedulerOutput) -> StepRecord:
    """The record of one step from what its schedule() decided (shared by engine and sim)."""
    stats = out.kv_stats
    assert stats is not None, "schedule() always fills kv_stats"
    return StepRecord(
        step=step,
        start=start,
        duration=duration,
        num_prefill_tokens=out.num_prefill_tokens,
        num_decode_tokens=out.num_decode_tokens,
        num_prefill_reqs=sum(1 for s in out.scheduled if not s.is_decode),
        num_decode_reqs=sum(1 for s in out.scheduled if s.is_decode),
        num_running=out.num_running,
        num_waiting=out.num_waiting,
        kv_usage=stats.usage,
        kv_blocks_used=stats.num_used_blocks,
        internal_fragmentation=stats.internal_fragmentation,
        num_preemptions=len(out.preempted_req_ids),
        num_swapped_blocks=len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in),
        prefix_cache_queries=out.prefix_cache_queries,
        prefix_cache_hits=out.prefix_cache_hits,
        prefix_cache_hit_rate=out.prefix_cache_stats.hit_rate if out.prefix_cache_stats else 0.0,
    )


class StepTrace:
    """Writes every step's record to `--trace-file`. Nothing is kept in memory: each step's
    record comes back in its StepResult, and a caller that wants a history keeps its own."""

    def __init__(self, path: str | None = None) -> None:
        self._file: IO[str] | None = open(path, "w", buffering=1) if path else None

    def add(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str) -> list[StepRecord]:
    with open(path) as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]
