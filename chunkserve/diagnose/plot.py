"""`--plot`: the step timeline (duration per step, by kind) with the culprit steps marked."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkserve.engine.trace import StepRecord


def plot_timeline(records: Sequence[StepRecord], d: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    t0 = records[0].start
    kinds = {"decode only": ("tab:blue", lambda r: not r.num_prefill_tokens),
             "prefill only": ("tab:orange", lambda r: not r.num_decode_tokens),
             "mixed": ("tab:green", lambda r: r.num_prefill_tokens and r.num_decode_tokens)}
    fig, ax = plt.subplots(figsize=(11, 4))
    for label, (color, keep) in kinds.items():
        rs = [r for r in records if r.num_tokens and keep(r)]
        ax.scatter([r.start - t0 for r in rs], [r.duration * 1e3 for r in rs], s=6, c=color,
                   label=label)
    by_step = {r.step: r for r in records}
    for title, e in (("max", d["max"]), ("p99", d["p99"]["example"])):
        r = by_step.get(e["culprit"].get("step", e["end_step"]))
        if r is None:
            continue
        ax.scatter([r.start - t0], [r.duration * 1e3], s=120, facecolors="none",
                   edgecolors="red", linewidths=2)
        ax.annotate(f"{title}: {e['cause']} ({e['gap_ms']:.0f} ms gap)",
                    (r.start - t0, r.duration * 1e3), textcoords="offset points",
                    xytext=(8, 8), color="red", fontsize=8)
    ax.axhline(d["gaps"]["p99_ms"], color="gray", ls="--", lw=1, label="token gap p99")
    ax.set_yscale("log")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("step duration (ms)")
    ax.set_title("Step timeline; culprit steps circled")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
