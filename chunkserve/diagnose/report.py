"""`chunkserve diagnose`: the slowest token gaps of a step trace, their causes, and the flags.

The diagnosis is a plain dict (printed as text, or as JSON with --json): the trace's step fit,
the gap percentiles, and for the max gap and for the gaps at or above p99 the time split by
cause with the step and request behind it and the flag that would change it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkserve.diagnose.causes import CAUSES, Attributed, attribute_all
from chunkserve.diagnose.gaps import StepFit, weighted_percentile
from chunkserve.engine.trace import StepRecord


def diagnose(records: Sequence[StepRecord], prompt_lens: dict[str, int] | None = None,
             target_itl_ms: float | None = None) -> dict[str, Any]:
    busy = [r for r in records if r.num_tokens]
    if not busy:
        raise ValueError("the trace has no step that computed tokens: nothing to diagnose")
    fit, attributed = attribute_all(records)
    if not attributed:
        raise ValueError("the trace has no decode steps, so no token gaps to diagnose")
    gaps = [a.gap for a in attributed]
    p50, p99 = weighted_percentile(gaps, 50), weighted_percentile(gaps, 99)
    target = target_itl_ms / 1e3 if target_itl_ms else 2 * p50
    worst = max(attributed, key=lambda a: a.gap.seconds)
    tail = [a for a in attributed if a.gap.seconds >= p99]
    busy_s = sum(r.duration for r in busy)
    return {
        "num_steps": len(busy),
        "fit": {"overhead_ms": fit.overhead * 1e3, "per_token_ms": fit.per_token * 1e3,
                "per_attention_pair_ns": fit.per_pair * 1e9},
        "fixed_overhead_share": min(fit.overhead * len(busy) / busy_s, 1.0),
        "mean_tokens_per_step": sum(r.num_tokens for r in busy) / len(busy),
        "num_preemptions": sum(r.num_preemptions for r in records),
        "gaps": {"count": sum(g.count for g in gaps), "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
                 "max_ms": worst.gap.seconds * 1e3},
        "target_itl_ms": target * 1e3,
        "max": _explain(worst, records, fit, target, prompt_lens),
        "p99": _tail(tail, records, fit, target, prompt_lens),
    }


def _tail(tail: list[Attributed], records: Sequence[StepRecord], fit: StepFit, target: float,
          prompt_lens: dict[str, int] | None) -> dict[str, Any]:
    """The gaps at or above p99: how many tokens each cause accounts for, the main one explained."""
    counts = dict.fromkeys(CAUSES, 0)
    for a in tail:
        counts[a.cause] += a.gap.count
    main = max(CAUSES, key=lambda k: counts[k])
    example = max((a for a in tail if a.cause == main), key=lambda a: a.gap.seconds)
    total = sum(counts.values())
    return {"num_tokens": total,
            "cause_share": {k: v / total for k, v in counts.items() if v},
            "cause": main, "example": _explain(example, records, fit, target, prompt_lens)}


def _explain(a: Attributed, records: Sequence[StepRecord], fit: StepFit, target: float,
             prompt_lens: dict[str, int] | None) -> dict[str, Any]:
    c = dict(a.culprit)
    if prompt_lens and c.get("request_id") in prompt_lens:
        c["prompt_len"] = prompt_lens[c["request_id"]]
    budget = records[a.gap.last].token_budget
    return {
        "gap_ms": a.gap.seconds * 1e3, "steps": a.gap.last - a.gap.first + 1,
        "end_step": records[a.gap.last].step, "cause": a.cause,
        "share": a.parts[a.cause] / a.gap.seconds if a.gap.seconds else 0.0,
        "parts_ms": {k: v * 1e3 for k, v in a.parts.items() if v > 0},
        "culprit": c, "why": _why(a.cause, c, a, fit),
        "flag": _flag(a.cause, fit, target, budget, c.get("tokens", 0)),
    }


def _why(cause: str, c: dict[str, Any], a: Attributed, fit: StepFit) -> str:
    ms = a.parts[cause] * 1e3
    if cause in ("long_prefill", "attention_growth"):
        prompt = f", prompt {c['prompt_len']:,} tokens" if "prompt_len" in c else ""
        what = ("a prefill of {tokens:,} tokens" if cause == "long_prefill" else
                "attention of a {tokens:,}-token chunk over {cached:,} cached tokens").format(**c)
        return (f"step {c['step']} ({c['step_ms']:.0f} ms, {c['decodes']} decodes waiting) ran "
                f"{what} of request {c['request_id']}{prompt}: {ms:.0f} ms of the gap")
    if cause == "fixed_overhead":
        return (f"{c['steps']} step(s) of {c['tokens_per_step']:.0f} tokens; each pays "
                f"{fit.overhead * 1e3:.1f} ms whatever it carries: {ms:.0f} ms of the gap")
    if cause == "preemption_recompute":
        return (f"request(s) {', '.join(c['request_ids'])} recomputed after preemption: "
                f"{ms:.0f} ms of the gap")
    if cause == "queueing":
        return (f"request {c['request_ids'][0]} was preempted at step {c['preempted_at_step']} "
                f"(KV {c['kv_usage']:.0%} used, {c['running']} running, {c['waiting']} waiting) "
                f"and waited {ms:.0f} ms to be readmitted")
    return f"{c['decodes']} decodes in the step: {ms:.0f} ms of the gap"


def _pow2_at_most(n: int) -> int:
    return 1 << max(n, 1).bit_length() - 1


def _flag(cause: str, fit: StepFit, target: float, budget: int | None, tokens: int) -> str:
    adaptive = f"--chunk-policy adaptive --target-itl-ms {target * 1e3:.0f}"
    fits = max(_pow2_at_most(fit.tokens_within(target)), 32)
    if cause == "long_prefill" and tokens <= fits:
        # Already a chunk that fits the target alone: the gap is the whole step's work, which a
        # smaller static budget would only spread over more (overhead-paying) steps.
        return f"{adaptive} (sizes each step's chunk to what its decodes leave of the target)"
    if cause == "long_prefill":
        return (f"--enable-chunked-prefill --max-num-batched-tokens {fits} (a {target * 1e3:.0f} "
                f"ms step carries ~{fit.tokens_within(target):,} tokens), or {adaptive}")
    if cause == "fixed_overhead":
        now = f" (now {budget})" if budget else ""
        return (f"a larger --max-num-batched-tokens{now}: fewer steps, each paying "
                f"{fit.overhead * 1e3:.1f} ms once; e.g. {fits} for a {target * 1e3:.0f} ms "
                f"step, or {adaptive}")
    if cause == "attention_growth":
        return (f"--long-prefill-token-threshold {max(fits // 2, 32)} or {adaptive}: smaller "
                "chunks once a long prompt's context has grown")
    if cause in ("preemption_recompute", "queueing"):
        return ("more KV (--kv-cache-memory / --num-kv-blocks), fewer concurrent requests "
                "(--max-num-seqs), or --preemption-mode swap")
    return "fewer concurrent decodes (--max-num-seqs)"
