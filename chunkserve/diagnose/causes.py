"""Why a token gap was long: its time split into what the steps inside it spent it on.

Each gap's seconds are divided with the trace's own step fit (gaps.StepFit) into
- long_prefill: new prompt tokens (and their attention) in the gap: head-of-line blocking;
- fixed_overhead: what every step pays whatever it carries, times the steps in the gap;
- attention_growth: attention of chunks that follow cached context (late chunks of long
  prompts cost more per token as the context grows), in mixed steps;
- preemption_recompute: tokens recomputed after a preemption;
- decode_batch: the decodes themselves;
and the largest part is the cause. A preempted request's own gap (waiting to be readmitted,
then recomputing) is rebuilt from the recompute it shows in the trace: queueing when the wait
(no free KV or slot) is the larger part, preemption_recompute otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkserve.diagnose.gaps import Gap, StepFit, attention_work, end, fit_steps, token_gaps
from chunkserve.engine.trace import StepRecord

CAUSES = ("long_prefill", "fixed_overhead", "attention_growth", "preemption_recompute",
          "queueing", "decode_batch")


@dataclass
class Attributed:
    gap: Gap
    parts: dict[str, float]  # seconds per cause (plus "unexplained")
    cause: str
    culprit: dict = field(default_factory=dict)  # the step and request behind the cause


def recompute_entries(records: Sequence[StepRecord]) -> set[tuple[int, str]]:
    """(step index, request id) of prefills that redo tokens a request had computed before."""
    progress: dict[str, int] = {}
    redo: set[tuple[int, str]] = set()
    for i, r in enumerate(records):
        for rid, n, cached in r.prefill_requests:
            # Prefills are the only entries (decodes are not listed), so progress is the prompt
            # computed so far; starting below it again means the KV was dropped.
            if cached < progress.get(rid, 0):
                redo.add((i, rid))
            progress[rid] = max(progress.get(rid, 0), cached + n)
    return redo


def _step_parts(r: StepRecord, i: int, fit: StepFit, redo: set[tuple[int, str]]) -> dict[str, float]:
    parts = dict.fromkeys(CAUSES, 0.0)
    parts["fixed_overhead"] = fit.overhead if r.num_tokens else 0.0
    parts["decode_batch"] = fit.per_token * r.num_decode_tokens
    mixed = r.num_decode_reqs > 0
    for rid, n, cached in r.prefill_requests:
        attention = fit.per_pair * n * (cached + n / 2)
        if (i, rid) in redo:
            parts["preemption_recompute"] += fit.per_token * n + attention
        elif cached > 0 and mixed:
            parts["long_prefill"] += fit.per_token * n
            parts["attention_growth"] += attention
        else:
            parts["long_prefill"] += fit.per_token * n + attention
    if not r.prefill_requests:  # an older trace: token counts only
        parts["long_prefill"] += fit.per_token * r.num_prefill_tokens
    return parts


def attribute(gap: Gap, records: Sequence[StepRecord], fit: StepFit,
              redo: set[tuple[int, str]]) -> Attributed:
    parts = dict.fromkeys(CAUSES, 0.0)
    for i in range(gap.first, gap.last + 1):
        for k, v in _step_parts(records[i], i, fit, redo).items():
            parts[k] += v
    total = sum(parts.values())
    if total > gap.seconds > 0:  # the fit overshoots this gap: keep the proportions, not the sum
        parts = {k: v * gap.seconds / total for k, v in parts.items()}
    parts["unexplained"] = max(gap.seconds - sum(parts.values()), 0.0)
    cause = max(CAUSES, key=lambda k: parts[k])
    return Attributed(gap, parts, cause, culprit(cause, gap, records, redo))


def culprit(cause: str, gap: Gap, records: Sequence[StepRecord],
            redo: set[tuple[int, str]]) -> dict:
    window = range(gap.first, gap.last + 1)
    if cause in ("long_prefill", "attention_growth"):
        after = cause == "attention_growth"

        def weight(i: int) -> float:
            r = records[i]
            return attention_work(r, True) if after else r.num_prefill_tokens

        i = max(window, key=weight)
        entries = records[i].prefill_requests
        if after:  # the chunk whose attention over cached context is the largest
            entries = [e for e in entries if e[2] > 0] or entries
            key = lambda e: e[1] * (e[2] + e[1] / 2)  # noqa: E731
        else:  # the largest prefill, first chunk or late one: its tokens are the stall
            key = lambda e: e[1]  # noqa: E731
        rid, n, cached = max(entries, key=key) if entries else (
            None, records[i].num_prefill_tokens, 0)
        return {"step": records[i].step, "request_id": rid, "tokens": n, "cached": cached,
                "step_ms": records[i].duration * 1e3, "decodes": gap.count}
    if cause == "preemption_recompute":
        ids = sorted({rid for i in window for rid, *_ in records[i].prefill_requests
                      if (i, rid) in redo})
        return {"request_ids": ids, "preemptions": sum(records[i].num_preemptions for i in window)}
    steps = [records[i] for i in window]
    return {"step": steps[-1].step, "steps": len(steps),
            "tokens_per_step": sum(r.num_tokens for r in steps) / len(steps),
            "decodes": steps[-1].num_decode_reqs}


def preempted_gaps(records: Sequence[StepRecord], redo: set[tuple[int, str]]) -> list[Attributed]:
    """One gap per preempted request: from the step that preempted it (the last preempting step
    before its recompute) to the end of its recompute; split into the wait and the recompute."""
    out: list[Attributed] = []
    by_rid: dict[str, list[int]] = {}
    for i, rid in sorted(redo):
        by_rid.setdefault(rid, []).append(i)
    for rid, steps in by_rid.items():
        first, last = steps[0], steps[-1]
        p = next((k for k in range(first - 1, -1, -1) if records[k].num_preemptions), None)
        if p is None:
            continue
        wait = records[first].start - records[p].start
        redo_s = sum(records[i].duration for i in steps)
        gap = Gap(p, last, end(records[last]) - records[p].start, 1)
        parts = dict.fromkeys(CAUSES, 0.0)
        parts["queueing"], parts["preemption_recompute"] = wait, redo_s
        parts["unexplained"] = max(gap.seconds - wait - redo_s, 0.0)
        cause = "queueing" if wait > redo_s else "preemption_recompute"
        out.append(Attributed(gap, parts, cause, {
            "request_ids": [rid], "preempted_at_step": records[p].step,
            "kv_usage": max(records[k].kv_usage for k in range(p, first + 1)),
            "waiting": records[p].num_waiting, "running": records[p].num_running}))
    return out


def attribute_all(records: Sequence[StepRecord]) -> tuple[StepFit, list[Attributed]]:
    """Every token gap of the trace with its causes, and the step-time fit that explained them:
    the gaps between decodes, then each preempted request's wait and recompute."""
    fit = fit_steps(records)
    redo = recompute_entries(records)
    attributed = [attribute(g, records, fit, redo) for g in token_gaps(records)]
    return fit, attributed + preempted_gaps(records, redo)
