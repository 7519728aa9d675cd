"""Sweep output: results.json, the article's table with measured numbers, and the plots.

Shared by `bench sweep` (real engine) and the simulator, so both speak the same format.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers or CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

from chunkserve.benchlib.metrics import parse_goodput, parse_percentiles  # noqa: E402
from chunkserve.benchlib.sweep import AUTO, RunResult, SweepPoint, summarize  # noqa: E402
from chunkserve.engine.timeline import write_timeline  # noqa: E402
from chunkserve.engine.trace import write_trace  # noqa: E402

PLOTS = ("latency_vs_chunk.png", "tpot_cdf.png", "step_timeline.png")


def _label(entry: dict[str, Any]) -> str:
    return str(entry["chunk_size"])


def sweep_and_report(
    points: list[SweepPoint],
    run_one: Callable[[SweepPoint], RunResult],
    extra: dict[str, Any],
    args: argparse.Namespace,
    title: str,
    command: str,
) -> int:
    """Runs every configuration, then writes results.json, table.md and the plots to --out.

    Shared by the real sweep and the simulator so that both report in one format.
    """
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    os.makedirs(args.out, exist_ok=True)
    entries: list[dict[str, Any]] = []
    runs: list[RunResult] = []
    for point in points:
        t0 = time.monotonic()
        run = run_one(point)
        run.extra = dict(extra)
        entry = summarize(run, percentiles, goodput)
        entries.append(entry)
        runs.append(run)
        print(
            f"chunk_size={point.label!s:>5} {point.scheduler:<13} "
            f"TTFT p50 {entry['median_ttft_ms']:8.0f} ms  TPOT p99 {entry['p99_tpot_ms']:7.1f} ms  "
            f"ITL p99 {entry['p99_itl_ms']:7.1f} ms  max gap {entry['max_itl_ms']:7.0f} ms  "
            f"({time.monotonic() - t0:.1f} s)",
            flush=True,
        )
        write_results(args.out, entries)  # after every point: a long sweep keeps what it did
        if getattr(args, "trace_dir", None):
            _write_step_trace(args, point, run, simulated=bool(extra.get("simulated")))
    write_table(args.out, entries, title, command)
    plot_all(args.out, entries, runs)
    print(table_markdown(entries, title, command))
    return 0


def _write_step_trace(args: argparse.Namespace, point: SweepPoint, run: RunResult,
                      simulated: bool) -> None:
    """--trace-dir: the configuration's step trace, as JSON lines or a Perfetto timeline."""
    os.makedirs(args.trace_dir, exist_ok=True)
    name = os.path.join(args.trace_dir, f"steps-{point.label}")
    if getattr(args, "trace_format", None) == "perfetto":
        write_timeline(name + ".json", run.records, simulated)
    else:
        write_trace(name + ".jsonl", run.records)


def write_results(out_dir: str, entries: list[dict[str, Any]]) -> str:
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump(entries, f, indent=2)
    return path


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def table_markdown(entries: list[dict[str, Any]], title: str, command: str) -> str:
    """The article's table, one row per chunk size, measured numbers in place of its words.

    Its columns map as: TTFT → TTFT p50/p99; TPOT → TPOT p50/p99 plus the token-gap columns
    (ITL p99, max gap: a head-of-line stall is one long gap, which per-request TPOT averages
    away); p99 latency → E2E p99; "GPU SM use" → how full and how costly steps are (tokens per
    step, fixed-overhead share of step time).
    """
    head = (
        "| chunk_size | scheduler | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | **ITL p99 (ms)** "
        "| **max gap (ms)** | E2E p99 (ms) | output tok/s | goodput (req/s) | tokens/step "
        "| step overhead share | preemptions | peak KV | mean frag (tokens) |"
    )
    lines = [f"# {title}", "", f"Command: `{command}`", "", head, "|" + "---|" * 14]
    for e in entries:
        goodput = e.get("request_goodput")
        lines.append(
            f"| {_label(e)} | {e['scheduler']} "
            f"| {_ms(e.get('median_ttft_ms'))} / {_ms(e.get('p99_ttft_ms'))} "
            f"| {_ms(e.get('median_tpot_ms'))} / {_ms(e.get('p99_tpot_ms'))} "
            f"| **{_ms(e.get('p99_itl_ms'))}** | **{_ms(e.get('max_itl_ms'))}** "
            f"| {_ms(e.get('p99_e2el_ms'))} | {e['output_throughput']:.1f} "
            f"| {'–' if goodput is None else f'{goodput:.2f}'} "
            f"| {e['mean_tokens_per_step']:.0f} | {e['step_overhead_share']:.0%} "
            f"| {e['num_preemptions']} | {e['peak_kv_usage']:.0%} "
            f"| {e['mean_internal_fragmentation_tokens']:.1f} |"
        )
    lines += ["", best_line(entries), ""]
    return "\n".join(lines)


def best_line(entries: list[dict[str, Any]]) -> str:
    def best(key: str, highest: bool = False) -> str:
        valid = [e for e in entries if e.get(key) is not None]
        if not valid:
            return "–"
        pick = (max if highest else min)(valid, key=lambda e: e[key])
        return f"chunk_size {_label(pick)} ({pick[key]:,.1f})"

    return (
        f"Best for TTFT (p50 ms): {best('median_ttft_ms')}; "
        f"for TPOT p99 (ms): {best('p99_tpot_ms')}; "
        f"for token-gap p99 (ITL ms): {best('p99_itl_ms')}; "
        f"for throughput (output tok/s): {best('output_throughput', highest=True)}."
    )


def write_table(out_dir: str, entries: list[dict[str, Any]], title: str, command: str) -> str:
    path = os.path.join(out_dir, "table.md")
    with open(path, "w") as f:
        f.write(table_markdown(entries, title, command))
    return path


def plot_all(out_dir: str, entries: list[dict[str, Any]], runs: Sequence[RunResult]) -> list[str]:
    return [
        _plot_latency(out_dir, entries),
        _plot_cdf(out_dir, runs),
        _plot_timeline(out_dir, runs),
    ]


def plain_log_scale(ax: Any, which: str) -> None:
    """A log `which` ("x" or "y") axis labelled with plain numbers (1000, not 10³):
    matplotlib's default labels are mathtext, and parsing them took about half of a simulated
    sweep's run time."""
    if which == "x":
        ax.set_xscale("log")
        axis = ax.xaxis
    else:
        ax.set_yscale("log")
        axis = ax.yaxis
    axis.set_major_formatter(ticker.LogFormatter())
    axis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))


def _latency_x(entries: list[dict[str, Any]]) -> np.ndarray:
    """Each entry's place on the latency plot's x axis: the ladder (chunk sizes and none) in
    sweep order at 0, 1, ...; `auto` entries left of it at -1, -2, ... A line joins the
    ladder's points only: auto is not a size between two others."""
    x = np.empty(len(entries))
    ladder = autos = 0
    for i, e in enumerate(entries):
        if e["chunk_size"] == AUTO:
            autos += 1
            x[i] = -autos
        else:
            x[i] = ladder
            ladder += 1
    return x


def _plot_series(ax: Any, x: np.ndarray, entries: list[dict[str, Any]], key: str,
                 name: str) -> None:
    y = np.array([e.get(key) or np.nan for e in entries])
    on_ladder = x >= 0
    (line,) = ax.plot(x[on_ladder], y[on_ladder], marker="o", label=name)
    if not on_ladder.all():
        ax.plot(x[~on_ladder], y[~on_ladder], marker="*", markersize=12, linestyle="none",
                color=line.get_color())


def _plot_latency(out_dir: str, entries: list[dict[str, Any]]) -> str:
    x = _latency_x(entries)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, name in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
        _plot_series(ax1, x, entries, key, name)
    for key, name in (
        ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"), ("p99_itl_ms", "ITL p99"),
        ("max_itl_ms", "max token gap"),
    ):
        _plot_series(ax2, x, entries, key, name)
    for ax, title in ((ax1, "Time to first token"), (ax2, "Time per output token / token gaps")):
        ax.set_xticks(x, [_label(e) for e in entries])
        ax.set_xlabel("chunk size (max_num_batched_tokens); none = no chunking")
        if (x < 0).any():  # auto (stars) apart from the ladder
            ax.axvline(-0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel("ms")
        plain_log_scale(ax, "y")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, PLOTS[0])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_cdf(out_dir: str, runs: Sequence[RunResult]) -> str:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        ok = [r for r in run.results if r.success]
        tpots = sorted((r.latency - r.ttft) / (r.output_len - 1) * 1000 for r in ok if r.output_len > 1)
        gaps = sorted(g * 1000 for r in ok for g in r.itl)
        name = f"chunk {run.point.label}"
        for ax, values in ((ax1, tpots), (ax2, gaps)):
            if values:
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
    ax1.set_title("Per-request TPOT (CDF)")
    ax2.set_title("Token gaps, ITL (CDF): a stall is one long gap")
    for ax in (ax1, ax2):
        plain_log_scale(ax, "x")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, PLOTS[1])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline_runs(runs: Sequence[RunResult]) -> list[RunResult]:
    """The no-chunk baseline (if any), the middle chunked configuration and `auto` (if any)."""
    base = [r for r in runs if r.point.no_chunk]
    chunked = [r for r in runs if not r.point.no_chunk and not r.point.auto]
    picks = base[:1]
    if chunked:
        picks.append(chunked[len(chunked) // 2])
    picks += [r for r in runs if r.point.auto][:1]
    return picks or list(runs[:1])


def _window(runs: Sequence[RunResult]) -> tuple[float, float]:
    """A time window around the longest step of the first run, shared by every panel.

    Runs replay the same arrivals, so the same window shows the same requests; a whole run is
    too long for individual steps to be visible.
    """
    recs = [r for r in runs[0].records if r.num_tokens > 0]
    if not recs:
        return 0.0, 1.0
    t0 = recs[0].start
    longest = max(recs, key=lambda r: r.duration)
    width = 12 * longest.duration
    start = max(0.0, longest.start - t0 - width / 3)
    return start, start + width


def _plot_timeline(out_dir: str, runs: Sequence[RunResult]) -> str:
    picks = _timeline_runs(runs)
    lo, hi = _window(picks) if picks else (0.0, 1.0)
    top = max((r.duration for run in picks for r in run.records), default=1.0) * 1000 * 1.1
    fig, axes = plt.subplots(len(picks), 1, figsize=(11, 3.2 * len(picks)), squeeze=False)
    for ax, run in zip(axes[:, 0], picks):
        recs = [r for r in run.records if r.num_tokens > 0]
        if not recs:
            continue
        t0 = recs[0].start
        recs = [r for r in recs if lo <= r.start - t0 <= hi]
        starts = np.array([r.start - t0 for r in recs])
        widths = np.array([r.duration for r in recs])
        prefill = np.array([r.num_prefill_tokens for r in recs])
        decode = np.array([r.num_decode_tokens for r in recs])
        ax.bar(starts, prefill, width=widths, align="edge", color="tab:orange", alpha=0.6,
               label="prefill tokens")
        ax.bar(starts, decode, width=widths, bottom=prefill, align="edge", color="tab:blue",
               alpha=0.6, label="decode tokens")
        ax.set_ylabel("tokens in step")
        ax.set_xlabel("time since the first step (s)")
        ax.set_xlim(lo, hi)
        twin = ax.twinx()
        twin.step(starts + widths, widths * 1000, where="pre", color="black", lw=0.9,
                  label="step duration")
        twin.set_ylim(0, top)  # one scale for every panel: stalls compare at a glance
        twin.set_ylabel("step duration (ms)")
        ax.set_title(f"chunk size {run.point.label} ({run.point.scheduler}): each bar is one "
                     "step, as wide as it took; decodes wait for the whole step")
        ax.legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, PLOTS[2])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
