"""Where the engine's compute runs beside the API server (issue 53): today's one process (the
engine stepped on a compute thread, HTTP on the event loop, both on every core) against vLLM's
arrangement (the engine in a process of its own, VLLM_ENABLE_V1_MULTIPROCESSING=1), with the
cores shared or one of them kept for the API server (VLLM_CPU_NUM_OF_RESERVED_CPU=1: vLLM's
default on x86, the engine on the rest).

Each arrangement is a fresh `chunkserve serve` of --model, driven by `chunkserve bench serve`
with the article's mixed workload: capacity (closed loop, 16 concurrent) and an open loop at
--load of the first arrangement's capacity; --rounds alternate the arrangements, so a
neighbour's burst spoils a round, not a column. Writes placement.json and placement.md to --out.

    .venv/bin/python benchmarks/serving/engine_placement.py --out DIR [--rounds 1]
        [--model smollm2-135m] [--capacity-prompts 48] [--open-loop-prompts 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info  # noqa: E402
from benchmarks.common.report import save_report  # noqa: E402
from benchmarks.serving import served  # noqa: E402

# name: (short name for the files, environment)
ARRANGEMENTS: dict[str, tuple[str, dict[str, str]]] = {
    "one process (today)": ("inproc", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    "engine process, cores shared": ("mp-shared", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    "engine process, 1 core kept for the server": (
        "mp-reserved", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}),
}


def measure(tag: str, env: dict[str, str], model: str, out_dir: str, phase: str,
            traffic: list[str], num_prompts: int) -> dict[str, Any]:
    """One fresh server in arrangement `env`, one bench; files OUT/TAG-PHASE.*"""
    port = served.free_port()
    cmd = [sys.executable, "-m", "chunkserve.cli", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", str(port)]
    result = served.measure_server(tag, cmd, port, out_dir, phase, traffic, num_prompts, model,
                                   env={**os.environ, **env})
    result["failed"] = served.failed_count(result)
    return result


def table(results: dict[str, dict[str, list[dict[str, Any]]]], phase: str) -> list[str]:
    names = list(results)
    lines = [f"| metric (median of rounds) | {' | '.join(names)} |",
             "|---|" + "---:|" * len(names)]
    for label, key, _ in served.ROWS:
        cells = [statistics.median(r[key] for r in results[n][phase]) for n in names]
        fmt = "{:,.3f}" if key == "request_throughput" else "{:,.1f}"
        lines.append(f"| {label} | " + " | ".join(fmt.format(c) for c in cells) + " |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--capacity-prompts", type=int, default=48)
    p.add_argument("--open-loop-prompts", type=int, default=30)
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--only", default=None, help="comma-separated short names to run, of "
                   + ", ".join(tag for tag, _ in ARRANGEMENTS.values()))
    args = p.parse_args()
    chosen = {n: a for n, a in ARRANGEMENTS.items()
              if args.only is None or a[0] in args.only.split(",")}
    if not chosen:
        p.error(f"--only {args.only!r} names none of the arrangements")
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        n: {"capacity": [], "open-loop": []} for n in chosen}
    first = next(iter(chosen))
    for i in range(args.rounds):
        for name, (tag, env) in chosen.items():
            results[name]["capacity"].append(measure(
                tag, env, args.model, args.out, f"capacity-{i}", served.CLOSED_LOOP,
                args.capacity_prompts))
            print(f"{name}: capacity {results[name]['capacity'][-1]['request_throughput']:.3f}"
                  " req/s", flush=True)
        rate = args.load * statistics.median(
            r["request_throughput"] for r in results[first]["capacity"])
        for name, (tag, env) in chosen.items():
            results[name]["open-loop"].append(measure(
                tag, env, args.model, args.out, f"open-loop-{i}",
                ["--request-rate", f"{rate:.4f}"], args.open_loop_prompts))
    cpu = cpu_info()
    lines = [f"# Engine placement on {cpu['model']} ({cpu['cores']} cores; "
             f"{' '.join(cpu['flags'])})", "",
             f"Model {args.model}, {args.rounds} round(s), {round(time.time() - started)} s; "
             f"command `python benchmarks/serving/engine_placement.py --out {args.out} "
             f"--rounds {args.rounds}" + (f" --only {args.only}" if args.only else "") + "`",
             "", "**capacity** (closed loop, 16 concurrent)", "",
             *table(results, "capacity"), "",
             f"**open loop** at {args.load:g} of the first arrangement's capacity", "",
             *table(results, "open-loop"), ""]
    save_report(args.out, "placement", {"cpu": cpu, "results": results}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
