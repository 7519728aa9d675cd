"""SLOs (`--slo ttft_p99:MS`) and objectives: what `chunkserve tune` holds each configuration to.

An SLO bounds a percentile of the whole run (p99 TTFT over all requests, as the benchmarks
report it); the `goodput` objective also counts requests one by one, vLLM's way (a request is
good when its own TTFT, TPOT and E2E latency meet the SLOs given for them).
"""
from __future__ import annotations

from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
SLO_KEYS = tuple(f"{m}_p{q}" for m in METRICS for q in PERCENTILES)
OBJECTIVES = ("goodput", "throughput", "ttft")


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`["ttft_p99:1000", "itl_p99:50"]` → {"ttft_p99": 1000.0, "itl_p99": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--slo: unknown key {key!r} in {item!r}; expected one of "
                             f"{', '.join(SLO_KEYS)} (as KEY:MS)")
        try:
            ms = float(value) if sep else float("nan")
        except ValueError:
            ms = float("nan")
        if not ms > 0:
            raise ValueError(f"--slo: expected {key}:MS with a positive number of ms, got {item!r}")
        if key in slos:
            raise ValueError(f"--slo: {key} is given twice")
        slos[key] = ms
    return slos


def entry_key(slo_key: str) -> str:
    """The results.json key of an SLO's metric: ttft_p99 → p99_ttft_ms."""
    metric, q = slo_key.rsplit("_p", 1)
    return f"p{q}_{metric}_ms"


def slo_ratios(entry: dict[str, Any], slos: dict[str, float]) -> dict[str, float]:
    """Each SLO's metric over its limit: ≤ 1 is met."""
    return {k: entry[entry_key(k)] / v for k, v in slos.items()}


def meets(entry: dict[str, Any], slos: dict[str, float]) -> bool:
    return all(r <= 1.0 for r in slo_ratios(entry, slos).values())


def goodput_slos(slos: dict[str, float]) -> dict[str, float] | None:
    """Per-request limits for vLLM's goodput (ttft, tpot, e2el: ITL has no per-request form
    there), from the SLOs' values; None when no SLO names one of them."""
    per_request = {k.split("_p")[0]: v for k, v in slos.items() if not k.startswith("itl")}
    return per_request or None


def all_per_request(slos: dict[str, float]) -> bool:
    """Whether goodput accounts for every SLO (it has no per-request form of ITL)."""
    return bool(slos) and not any(k.startswith("itl") for k in slos)


def objective_value(entry: dict[str, Any], objective: str) -> float:
    """Higher is better: goodput (req/s), throughput (output tok/s), or −TTFT p99 (ms)."""
    if objective == "goodput":
        goodput = entry.get("request_goodput")
        return entry["request_throughput"] if goodput is None else goodput
    if objective == "throughput":
        return entry["output_throughput"]
    if objective == "ttft":
        return -entry["p99_ttft_ms"]
    raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
