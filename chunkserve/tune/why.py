"""Why the pick, and not a smaller or a larger budget: the failure condition on each side.

The neighbours' simulated traces are read by `chunkserve diagnose` (the same attribution as for
a real trace), and its findings are named as the article's failure conditions:
- smaller budgets: fixed per-step overhead of small chunks (diagnose's fixed-overhead share);
- larger budgets: the cause of their worst token gap, i.e. head-of-line stall of the longest
  prompt (long_prefill) or attention growth of late chunks (attention_growth);
- either side: KV pressure, when the neighbour preempted more than the pick.
"""
from __future__ import annotations

from typing import Any

from chunkserve.diagnose.report import diagnose
from chunkserve.tune.search import Evaluated
from chunkserve.tune.slo import entry_key
from chunkserve.tune.space import describe

CONDITIONS = {
    "long_prefill": "head-of-line stall of the longest prompt",
    "attention_growth": "attention growth of late chunks of long prompts",
    "fixed_overhead": "fixed per-step overhead of small chunks",
    "preemption_recompute": "KV pressure → preemption",
    "queueing": "KV pressure → preemption",
    "decode_batch": "the decode batch itself",
}
SHOWN = ("p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "output_throughput")


def compare(e: Evaluated, pick: Evaluated, slos: dict[str, float]) -> list[str]:
    """The metrics where `e` is worse than the pick, with the SLO it breaks."""
    keys = list(dict.fromkeys([entry_key(k) for k in slos] + list(SHOWN)))
    limits = {entry_key(k): v for k, v in slos.items()}
    out = []
    for key in keys:
        mine, theirs = e.entry[key], pick.entry[key]
        higher_is_better = key == "output_throughput"
        if (mine < theirs * 0.99) if higher_is_better else (mine > theirs * 1.01):
            slo = f", SLO {limits[key]:,.0f}" + (" broken" if mine > limits[key] else "") \
                if key in limits else ""
            out.append(f"{key} {mine:,.1f} vs {theirs:,.1f}{slo}")
    return out


def condition(e: Evaluated, pick: Evaluated, side: str, d: dict[str, Any]) -> tuple[str, str]:
    """(failure condition, the numbers behind it) for a neighbour on `side` (below/above)."""
    extra = e.entry["num_preemptions"] - pick.entry["num_preemptions"]
    if extra > 0:
        return CONDITIONS["queueing"], (f"{e.entry['num_preemptions']} preemptions (pick: "
                                        f"{pick.entry['num_preemptions']}), peak KV "
                                        f"{e.entry['peak_kv_usage']:.0%}")
    if side == "below":
        return CONDITIONS["fixed_overhead"], (
            f"{d['fixed_overhead_share']:.0%} of busy time is the fixed "
            f"{d['fit']['overhead_ms']:.2f} ms every step pays, at "
            f"{d['mean_tokens_per_step']:.0f} tokens/step (pick: "
            f"{pick.entry['mean_tokens_per_step']:.0f})")
    worst = d["max"]
    return CONDITIONS[worst["cause"]], f"max gap {worst['gap_ms']:,.0f} ms: {worst['why']}"


def bound(e: Evaluated | None, pick: Evaluated, side: str, slos: dict[str, float],
          prompt_lens: dict[str, int]) -> dict[str, Any] | None:
    if e is None:
        return None
    d = diagnose(e.run.records, prompt_lens)
    name, numbers = condition(e, pick, side, d)
    return {"side": side, "config": describe(e.point), "condition": name, "numbers": numbers,
            "worse": compare(e, pick, slos)}


def explain(pick: Evaluated, below: Evaluated | None, above: Evaluated | None,
            slos: dict[str, float], prompt_lens: dict[str, int]) -> dict[str, Any]:
    """The pick's own worst gap, and what bounds it from each side."""
    d = diagnose(pick.run.records, prompt_lens)
    return {
        "pick": {"max_gap_ms": d["gaps"]["max_ms"], "cause": CONDITIONS[d["max"]["cause"]],
                 "why": d["max"]["why"], "fixed_overhead_share": d["fixed_overhead_share"]},
        "below": bound(below, pick, "below", slos, prompt_lens),
        "above": bound(above, pick, "above", slos, prompt_lens),
    }
