"""The step trace: one record per engine step, the ground truth for every latency analysis.

The record's fields are a stable contract (docs/trace.md): simulated steps get the same records
(the same engine loop makes them) and the benchmarks read them. Add fields at the end; never
rename or drop one.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, field, fields
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
    # Added by issue 14 (defaults let older traces load):
    token_budget: int | None = None  # the step's token budget: max_num_batched_tokens, or the
    # adaptive chunk policy's choice for this step
    # [request_id, tokens, cached before] per prefill in the step: names the request behind a
    # long step (decodes are left out: one token each, and there can be hundreds). "Cached
    # before" is the chunk's start: earlier chunks plus, on a request's first chunk, its
    # prefix-cache hit (those tokens were never computed in any step).
    prefill_requests: list[list] = field(default_factory=list)
    # Added by issue 28: the learning step-time model (sim/online_model.py), when the adaptive
    # policy plans with one. Its prediction of this step (made before it ran), the median
    # relative error of its recent predictions, and its coefficients (seconds per unit of each
    # cost-model feature) on the steps where it refit, None on the others.
    predicted_duration: float | None = None
    step_model_error: float | None = None
    step_model_coefficients: dict[str, float] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def step_record(step: int, start: float, duration: float, out: SchedulerOutput) -> StepRecord:
    """The record of one step from what its schedule() decided (shared by engine and sim)."""
    stats = out.kv_stats
    assert stats is not None, "schedule() always fills kv_stats"
    # One pass: a simulated run makes hundreds of thousands of these records.
    prefills = [[s.request.request_id, s.num_new_tokens, s.start] for s in out.scheduled
                if not s.is_decode]
    num_decodes = len(out.scheduled) - len(prefills)
    return StepRecord(
        step=step,
        start=start,
        duration=duration,
        num_prefill_tokens=sum(p[1] for p in prefills),
        num_decode_tokens=num_decodes,  # one token each
        num_prefill_reqs=len(prefills),
        num_decode_reqs=num_decodes,
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
        token_budget=out.token_budget,
        prefill_requests=prefills,
    )


class StepTrace:
    """Writes every step's record to `--trace-file`. Nothing is kept in memory: each step's
    record comes back in its StepResult, and a caller that wants a history keeps its own."""

    def __init__(self, path: str | None = None) -> None:
        self._file: IO[str] | None = open(path, "w", buffering=1) if path else None

    def add(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(_line(record))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _line(record: StepRecord) -> str:
    return json.dumps(asdict(record)) + "\n"


def write_trace(path: str, records: list[StepRecord]) -> None:
    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        for record in records:
            f.write(_line(record))


_FIELDS = {f.name for f in fields(StepRecord)}


def read_trace(path: str) -> list[StepRecord]:
    """Every record of a JSONL trace; a ValueError naming the line for anything else."""
    records = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                # Fields added by a newer version are dropped rather than refused (docs/trace.md:
                # fields are only ever added), so an old reader still reads a new trace.
                records.append(StepRecord(**{k: v for k, v in data.items() if k in _FIELDS}))
            except (json.JSONDecodeError, TypeError, AttributeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not a step record ({e})") from None
    return records
