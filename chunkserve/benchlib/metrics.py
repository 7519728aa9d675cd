"""Serving metrics as `vllm bench serve` computes and prints them, so results compare 1:1.

Times come in as seconds (perf_counter based) and go out in milliseconds under vLLM's keys.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")

# (key, row label, section header) in vLLM's print order.
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass
class RequestResult:
    success: bool
    prompt_len: int
    output_len: int          # completion tokens (usage.completion_tokens when available)
    ttft: float              # seconds; 0 when failed
    itl: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    latency: float = 0.0     # e2el seconds
    start_time: float = 0.0  # send time, seconds (perf_counter based)
    generated_text: str = ""
    error: str = ""


def parse_percentiles(text: str) -> list[float]:
    """--percentiles / --metric-percentiles: "50,90,99" -> [50.0, 90.0, 99.0]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"percentiles must be comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"percentiles must be numbers in [0, 100], got {text!r}")
    return values


def parse_goodput(pairs: list[str] | None) -> dict[str, float] | None:
    """--goodput KEY:MS ... -> {key: ms}; None when no SLO is given (goodput is then null)."""
    if not pairs:
        return None
    slos: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput key must be ttft, tpot or e2el, got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput expects KEY:MS pairs, got {pair!r}") from None
        if not slos[name] >= 0:
            raise ValueError(f"--goodput value must be non-negative, got {pair!r}")
    return slos


def percentile_label(p: float) -> str:
    """vLLM's spelling of a percentile in keys and rows: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _stats_ms(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    # vLLM reduces `values or 0`: an empty list (nothing completed) reports zeros, not NaN.
    data = values or [0.0]
    out = {
        f"mean_{name}_ms": float(np.mean(data)) * 1000,
        f"median_{name}_ms": float(np.median(data)) * 1000,
        f"std_{name}_ms": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        out[f"p{percentile_label(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    return out


def _peaks(done: list[RequestResult]) -> tuple[float, int]:
    """Peak tokens in any one-second bucket, and peak simultaneous requests."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    end = max(r.start_time + r.latency for r in done)
    buckets = np.zeros(int(math.ceil(end - t0)) + 1)
    for r in done:
        # Each content chunk's arrival: first at start + ttft, then one per ITL gap.
        times = r.start_time + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        idx = (times - t0).astype(int)
        np.add.at(buckets, idx[(idx >= 0) & (idx < len(buckets))], 1)
    # Sweep over half-open [start, end): a request ending exactly when another starts does not
    # overlap it (ends sort before starts at equal times).
    events = sorted([(r.start_time, 1) for r in done]
                    + [(r.start_time + r.latency, -1) for r in done])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return float(buckets.max()), peak


def compute_metrics(results: list[RequestResult], duration: float,
                    selected_percentiles: list[float],
                    goodput_slos: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's benchmark metrics; latency statistics in ms; failed requests only count as failed.

    goodput_slos maps ttft/tpot/e2el to a limit in ms; a completed request is "good" when it is
    within every given limit (a request with one output token has TPOT 0, as in vLLM).
    """
    unknown = set(goodput_slos or {}) - set(GOODPUT_METRICS)
    if unknown:
        raise ValueError(f"goodput SLOs must be among {GOODPUT_METRICS}, got {sorted(unknown)}")
    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done]
    e2els = [r.latency for r in done]
    itls = [gap for r in done for gap in r.itl]
    # TPOT is undefined for a single output token: left out of the statistics, 0 for goodput.
    per_request_tpot = [(r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
                        for r in done]
    tpots = [t for t, r in zip(per_request_tpot, done) if r.output_len > 1]

    good = None
    if goodput_slos:
        per_metric = {"ttft": ttfts, "tpot": per_request_tpot, "e2el": e2els}
        good = sum(
            all(per_metric[k][i] <= slo_ms / 1000 for k, slo_ms in goodput_slos.items())
            for i in range(len(done))
        )

    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    peak_tokens, peak_concurrency = _peaks(done)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": None if good is None else good / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats_ms(name, values, selected_percentiles))
    # Ours: the single worst token gap, where a long prefill stalling running decodes shows up
    # even when it is too rare to move P99.
    metrics["max_itl_ms"] = max(itls, default=0.0) * 1000
    return metrics


def print_summary(metrics: dict[str, Any], *, selected_percentile_metrics: Sequence[str] = (
                      "ttft", "tpot", "itl"),
                  selected_percentiles: Sequence[float] = (99,),
                  max_concurrency: int | None = None, request_rate: float = math.inf,
                  file: TextIO | None = None) -> None:
    """vLLM's result table, plus a "Max ITL (ms)" row in the ITL section."""
    out = file or sys.stdout

    def row(label: str, value: Any, fmt: str = "") -> None:
        print(("{:<40} {:<10" + fmt + "}").format(label, value), file=out)

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), file=out)
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", metrics["duration"], ".2f")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"], ".2f")
    if metrics.get("request_goodput") is not None:
        row("Request goodput (req/s):", metrics["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", metrics["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    for key, name, header in _SECTIONS:
        if key not in selected_percentile_metrics:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"), file=out)
        row(f"Mean {name} (ms):", metrics[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", metrics[f"median_{key}_ms"], ".2f")
        for p in selected_percentiles:
            label = percentile_label(p)
            row(f"P{label} {name} (ms):", metrics[f"p{label}_{key}_ms"], ".2f")
        if key == "itl":
            row("Max ITL (ms):", metrics["max_itl_ms"], ".2f")
    print("=" * 50, file=out)
