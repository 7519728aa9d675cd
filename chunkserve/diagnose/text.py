"""The diagnosis as a short text report: the numbers behind each attribution, and the flag."""
from __future__ import annotations

from typing import Any

NAMES = {
    "long_prefill": "prefill in the gap (head-of-line)",
    "fixed_overhead": "many small steps (fixed per-step overhead)",
    "attention_growth": "mixed step, attention grown with context",
    "preemption_recompute": "preemption / recompute",
    "queueing": "queueing (no free KV or slot)",
    "decode_batch": "decode batch",
}


def _case(title: str, e: dict[str, Any]) -> list[str]:
    parts = ", ".join(f"{k} {v:.0f}" for k, v in
                      sorted(e["parts_ms"].items(), key=lambda kv: -kv[1]))
    return [
        f"{title}: {e['gap_ms']:,.0f} ms gap ending at step {e['end_step']} "
        f"({e['steps']} step(s)) -> {NAMES[e['cause']]} ({e['share']:.0%} of it)",
        f"  {e['why']}",
        f"  split (ms): {parts}",
        f"  change it with: {e['flag']}",
    ]


def format_text(d: dict[str, Any], path: str) -> str:
    g, fit = d["gaps"], d["fit"]
    lines = [
        f"{path}: {d['num_steps']} steps, {g['count']:,} decode tokens, "
        f"{d['num_preemptions']} preemptions",
        f"token gaps: p50 {g['p50_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms, max {g['max_ms']:,.0f} ms",
        f"step fit: {fit['overhead_ms']:.2f} ms fixed + {fit['per_token_ms']:.4f} ms/token + "
        f"{fit['per_attention_pair_ns']:.3f} ns/attention pair; fixed overhead is "
        f"{d['fixed_overhead_share']:.0%} of busy time at {d['mean_tokens_per_step']:.0f} "
        "tokens/step",
        "",
    ]
    lines += _case("max", d["max"])
    tail = d["p99"]
    shares = ", ".join(f"{NAMES[k]} {v:.0%}" for k, v in
                       sorted(tail["cause_share"].items(), key=lambda kv: -kv[1]))
    lines += ["", f"p99 tail ({tail['num_tokens']} tokens at or above p99): {shares}"]
    lines += _case("  largest of its main cause", tail["example"])
    return "\n".join(lines)
