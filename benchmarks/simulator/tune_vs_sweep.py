"""Is `chunkserve tune`'s pick as good as the best configuration found by measuring them all?

Runs `chunkserve tune`'s search on the simulator (--hardware: this machine's `chunkserve
profile`), then replays *every* configuration the search considered on the real engine — the
whole budget ladder, the no-chunk baseline and the stage-2 refinements (vLLM V1, prefill
thresholds, adaptive targets) — on the same requests and arrivals, ranks the measured runs
with tune's own rule (SLOs first, then the objective), and reports how far the pick's measured
objective is from the measured best. Writes DIR/tune_vs_sweep.{json,md} and every run's step
trace (DIR/traces/steps-<config>.jsonl.gz, for `chunkserve diagnose`).

    .venv/bin/python benchmarks/simulator/tune_vs_sweep.py --hardware PROFILE.json \
        --model smollm2-135m --dataset-name mixed --num-prompts 40 --load 0.5 \
        --slo ttft_p99:MS --slo tpot_p99:MS --chunk-sizes 32,64,128,256,512,1024,2048 --out DIR
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from chunkserve.bench.tune_runs import measure_tune_runs
from chunkserve.benchlib.sweep import summarize
from chunkserve.engine.trace import write_trace
from chunkserve.sim.cli import sim_workbench
from chunkserve.tune.cli import add_tune_args, check_tune_args
from chunkserve.tune.search import PERCENTILES, Evaluated, rank, search
from chunkserve.tune.slo import goodput_slos, meets, objective_value
from chunkserve.tune.space import describe

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402
from benchmarks.common.report import save_report  # noqa: E402

SHOWN = ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "max_itl_ms",
         "output_throughput", "request_goodput")


def row(name: str, predicted: Evaluated, measured: Evaluated, slos: dict[str, float]) -> dict:
    return {"config": name,
            "predicted": {k: predicted.entry.get(k) for k in SHOWN},
            "measured": {k: measured.entry.get(k) for k in SHOWN},
            # Predicted: held to the SLOs at the profile's speed and at the --speed-margin.
            "meets_slos": {"predicted": predicted.meets(slos),
                           "measured": meets(measured.entry, slos)}}


def fmt(v: Any) -> str:
    if not isinstance(v, float):
        return "–" if v is None else str(v)
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"  # goodput is a fraction of a req/s


def markdown(d: dict[str, Any]) -> str:
    lines = [f"# tune vs exhaustive real sweep: {d['workload']}", "",
             f"CPU: {d['cpu']}. SLOs: {d['slos']}; objective: {d['objective']}.", "",
             "| config | " + " | ".join(f"{k} pred / meas" for k in SHOWN)
             + " | meets SLOs pred / meas |",
             "|---" * (len(SHOWN) + 2) + "|"]
    for r in d["rows"]:
        cells = [f"{fmt(r['predicted'][k])} / {fmt(r['measured'][k])}" for k in SHOWN]
        ok = r["meets_slos"]
        lines.append(f"| {r['config']} | " + " | ".join(cells)
                     + f" | {'yes' if ok['predicted'] else 'no'} / "
                       f"{'yes' if ok['measured'] else 'no'} |")
    s = d["summary"]
    lines += ["", f"tune's pick: **{s['pick']}** (measured {d['objective']} "
                  f"{fmt(s['pick_measured'])}); best measured: **{s['best']}** "
                  f"({fmt(s['best_measured'])}); the pick is {s['gap']:.1%} below the best.",
              "", f"Highest measured {d['objective']} regardless of the aggregate SLOs: "
                  f"**{s['top_objective']}** ({fmt(s['top_objective_measured'])}); the pick is "
                  f"{s['gap_to_top']:.1%} below it."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tune_args(p)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    slos, space = check_tune_args(args)
    bench = sim_workbench(args, log=lambda line: print(line, file=sys.stderr))
    result = search(bench, space, slos, args.objective, args.speed_margin)
    predicted = result.ranked
    print(f"tune's pick: {describe(result.pick.point)}; replaying {len(predicted)} "
          f"configurations on the real engine", file=sys.stderr, flush=True)
    runs = measure_tune_runs(args, [e.point for e in predicted], bench.arrivals,
                             bench.config.num_kv_blocks)
    measured = [Evaluated(e.point, summarize(run, PERCENTILES, goodput_slos(slos)), run)
                for e, run in zip(predicted, runs)]
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    for m in measured:
        name = re.sub(r"[^a-z0-9.]+", "-", describe(m.point).lower()).strip("-")
        write_trace(os.path.join(args.out, "traces", f"steps-{name}.jsonl.gz"), m.run.records)
    real_best = rank(measured, slos, args.objective)[0]
    pick_real = next(m for m in measured if m.point == result.pick.point)
    best_v = objective_value(real_best.entry, args.objective)
    pick_v = objective_value(pick_real.entry, args.objective)
    # When no run meets the aggregate SLOs, tune's rule ranks by closeness to them; the top
    # objective alone (goodput already counts only requests within their SLOs) is shown too.
    top = max(measured, key=lambda m: objective_value(m.entry, args.objective))
    top_v = objective_value(top.entry, args.objective)
    d = {"cpu": cpu_model(), "slos": slos, "objective": args.objective,
         "workload": {"dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
                      "request_rate": bench.rate, "seed": args.seed,
                      "hardware": args.hardware},
         "command": " ".join(sys.argv),
         "rows": [row(describe(e.point), e, m, slos) for e, m in zip(predicted, measured)],
         "summary": {"pick": describe(result.pick.point), "best": describe(real_best.point),
                     "pick_measured": pick_v, "best_measured": best_v,
                     "gap": (best_v - pick_v) / abs(best_v) if best_v else 0.0,
                     "top_objective": describe(top.point), "top_objective_measured": top_v,
                     "gap_to_top": (top_v - pick_v) / abs(top_v) if top_v else 0.0,
                     "pick_meets_slos_measured": meets(pick_real.entry, slos)}}
    save_report(args.out, "tune_vs_sweep", d, markdown(d), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
