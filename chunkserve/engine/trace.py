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
    # Added by issue 31 (structured outputs): the rows whose sample this step was constrained
    # by a grammar mask, and the seconds their masks cost: the engine filling them (llguidance)
    # plus the sampler applying them to the logits. Host time: on a GPU the apply's kernels are
    # queued, not waited for. 0 on steps without such a row, and in the simulator.
    num_grammar_rows: int = 0
    grammar_mask_time: float = 0.0
    # Added by issue 32 (the timeline, engine/timeline.py): the requests whose state changed in
    # this step. [request_id, arrival time, prompt tokens] of those added since the previous
    # step; those that left the waiting queue (admitted, or resumed after a preemption); the
    # prefills whose chunk reached the end of their sequence, so they sampled a token (their
    # first, unless resuming after a recompute); those preempted; those that finished (or were
    # aborted since the previous step).
    arrived_requests: list[list] = field(default_factory=list)
    admitted_requests: list[str] = field(default_factory=list)
    sampled_prefills: list[str] = field(default_factory=list)
    preempted_requests: list[str] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def step_record(step: int, start: float, duration: float, out: SchedulerOutput,
                grammar_mask_time: float = 0.0, arrived: list[list] | None = None,
                finished: list[str] | None = None) -> StepRecord:
    """The record of one step from what its schedule() decided (shared by engine and sim);
    `grammar_mask_time` is what the step's grammar masks cost, `arrived` and `finished` the
    requests added since the previous step and finished in this one (StepRecord)."""
    stats = out.kv_stats
    assert stats is not None, "schedule() always fills kv_stats"
    # One pass: a simulated run makes hundreds of thousands of these records.
    prefills, sampled = [], []
    for s in out.scheduled:
        if not s.is_decode:
            prefills.append([s.request.request_id, s.num_new_tokens, s.start])
            if s.samples:
                sampled.append(s.request.request_id)
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
        num_grammar_rows=len(out.grammar_bitmask),
        grammar_mask_time=grammar_mask_time,
        arrived_requests=arrived or [],
        admitted_requests=list(out.admitted_req_ids),
        sampled_prefills=sampled,
        preempted_requests=list(out.preempted_req_ids),
        finished_requests=finished or [],
    )


TRACE_FORMATS = ("jsonl", "perfetto")


def trace_format_of(path: str, trace_format: str | None = None) -> str:
    """`--trace-format`, or by the file's name: `.json` (`.perfetto.json`) is a Perfetto
    timeline (engine/timeline.py), anything else JSON lines."""
    if trace_format is not None:
        if trace_format not in TRACE_FORMATS:
            raise ValueError(f"unknown trace format {trace_format!r}: choose "
                             f"{' or '.join(TRACE_FORMATS)}")
        return trace_format
    return "perfetto" if path.endswith(".json") else "jsonl"


def open_for_writing(path: str, what: str = "trace file") -> IO[str]:
    try:
        return open(path, "w", buffering=1)
    except OSError as e:
        raise OSError(f"cannot write the {what} {path!r}: {e.strerror}") from None


def record_line(record: StepRecord) -> str:
    """One record as its JSON line (the JSONL trace's format)."""
    return json.dumps(asdict(record)) + "\n"


def write_trace(path: str, records: list[StepRecord]) -> None:
    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        for record in records:
            f.write(record_line(record))


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
