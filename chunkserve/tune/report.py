"""`chunkserve tune`'s answer: a plain dict (the --json output) and its text form."""
from __future__ import annotations

from typing import Any

from chunkserve.tune.search import TIE, Evaluated, TuneResult
from chunkserve.tune.space import describe, kind

RUNNERS_UP = 5
METRIC_KEYS = ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "max_itl_ms",
               "output_throughput", "request_throughput", "request_goodput", "num_preemptions",
               "mean_tokens_per_step")
# How `auto` compares with the pick (tune/auto.py): (key, name, unit, higher is better)
AUTO_COMPARED = (("p99_ttft_ms", "TTFT p99", "ms", False), ("p99_itl_ms", "ITL p99", "ms", False),
                 ("max_itl_ms", "max gap", "ms", False),
                 ("request_goodput", "goodput", "req/s", True))


def candidate(e: Evaluated, slos: dict[str, float], objective: str) -> dict[str, Any]:
    return {
        "config": describe(e.point), "kind": kind(e.point), "chunk_size": e.point.chunk_size,
        "scheduler": e.point.scheduler, **e.point.policy_keys(), "budget": e.budget,
        "meets_slos": e.meets(slos), "worst_slo_ratio": e.worst_ratio(slos),
        "objective_value": e.value(objective),
        **{k: e.entry.get(k) for k in METRIC_KEYS},
        # The same configuration on the slower machine of --speed-margin (None: no margin).
        "slower": None if e.slow_entry is None else {k: e.slow_entry.get(k) for k in METRIC_KEYS},
    }


def tune_dict(result: TuneResult, slos: dict[str, float], objective: str,
              why: dict[str, Any], lines: dict[str, Any], speed_margin: float) -> dict[str, Any]:
    ranked = [candidate(e, slos, objective) for e in result.ranked]
    return {"objective": objective, "slos_ms": slos, "speed_margin": speed_margin,
            "recommendation": ranked[0],
            "commands": lines, "why": why, "runners_up": ranked[1:1 + RUNNERS_UP],
            "tied": result.tied, "all": ranked, "skipped": result.skipped}


def _metrics(c: dict[str, Any]) -> str:
    goodput = "–" if c["request_goodput"] is None else f"{c['request_goodput']:.2f}"
    return (f"TTFT p50/p99 {c['median_ttft_ms']:,.0f}/{c['p99_ttft_ms']:,.0f} ms, TPOT p99 "
            f"{c['p99_tpot_ms']:.1f} ms, ITL p99 {c['p99_itl_ms']:.1f} ms, max gap "
            f"{c['max_itl_ms']:,.0f} ms, {c['output_throughput']:,.0f} tok/s, goodput "
            f"{goodput} req/s, {c['num_preemptions']} preemptions")


def _bound_lines(b: dict[str, Any] | None, side: str) -> list[str]:
    if b is None:
        return [f"  {side}: nothing {'smaller' if side == 'below' else 'larger'} was tried"]
    worse = "; ".join(b["worse"]) or "no metric worse by more than 1%"
    return [f"  {side}: {b['config']} is bounded by {b['condition']}",
            f"    worse: {worse}", f"    because: {b['numbers']}"]


def format_text(d: dict[str, Any]) -> str:
    r, why, cmd = d["recommendation"], d["why"], d["commands"]
    slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in d["slos_ms"].items()) or "none"
    verdict = ("meets every SLO" if r["meets_slos"]
               else "NO configuration meets the SLOs: this one comes closest")
    margin = d["speed_margin"]
    lines = [f"objective: {d['objective']}; SLOs: {slos}"
             + (f"; judged at --hardware's speed and {margin:g}x slower (--speed-margin)"
                if r["slower"] else ""),
             f"recommendation: {r['config']} ({verdict})", f"  predicted: {_metrics(r)}"]
    if r["slower"]:
        lines.append(f"  {margin:g}x slower: {_metrics(r['slower'])}")
    if d["tied"] > 1:
        lines.append(f"  ({d['tied']} configurations are within {TIE:.0%} of the best "
                     f"{d['objective']}: this is the simplest, then the one with the most SLO "
                     "headroom)")
    lines += [f"  {cmd['chunkserve']}", f"  {cmd['vllm']}"]
    lines += [f"  ({cmd['vllm_note']})"] if cmd.get("vllm_note") else []
    p = why["pick"]
    lines += ["", "why:", f"  at the pick the worst token gap is {p['max_gap_ms']:,.0f} ms "
              f"({p['cause']}): {p['why']}"]
    lines += _bound_lines(why["below"], "below") + _bound_lines(why["above"], "above")
    lines += ["", "runners-up:"]
    lines += [f"  {c['config']}{'' if c['meets_slos'] else ' (misses an SLO)'}: {_metrics(c)}"
              for c in d["runners_up"]]
    lines += [f"skipped: {s}" for s in d["skipped"]]
    return "\n".join(lines + _auto_lines(d.get("auto"), d["objective"]))


def _number(v: float, unit: str) -> str:
    return f"{v:.2f}" if unit == "req/s" else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _versus_cell(name: str, unit: str, higher: bool, m: dict[str, Any]) -> str:
    if m["auto"] is None or m["pick"] is None:
        return f"{name} –"
    change = m["change"]
    if change is None or abs(change) < 0.01:
        how = "same"
    else:
        how = f"{change:+.0%}, {'better' if (change > 0) == higher else 'worse'}"
    return f"{name} {_number(m['auto'], unit)} vs {_number(m['pick'], unit)} {unit} ({how})"


def _auto_lines(a: dict[str, Any] | None, objective: str) -> list[str]:
    """auto (what `serve` runs without a chunking flag) beside the pick."""
    if a is None:
        return []
    slos = (f"{'meets every SLO' if a['meets_slos'] else 'misses an SLO'} "
            f"(the pick {'meets' if a['pick_meets_slos'] else 'misses'} them)")
    obj = "" if a["objective_vs_pick"] is None else \
        f"; {objective} {a['objective_vs_pick']:+.1%} vs the pick"
    cells = [_versus_cell(name, unit, higher, a["vs_pick"][key])
             for key, name, unit, higher in AUTO_COMPARED]
    return ["", "auto, the default (no chunking flag), against the pick:",
            f"  {a['config']}: {slos}{obj}", f"  predicted: {_metrics(a)}",
            f"  vs the pick: {'; '.join(cells)}", f"  {a['command']}"]
