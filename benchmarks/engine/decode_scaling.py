"""Decode step time against batch size on this CPU: chunkserve, llama.cpp, and the floor the
hardware allows, in one run.

Issue 11 asks for a B=64 decode step within 3x a B=1 step (and B=32 within 2.5x). This script
puts chunkserve's ratios beside:
  - llama.cpp's, on the same GGUF with the same threads, from its own `llama-batched-bench`
    (a 512-token prompt computed once and copied into each sequence's own KV stream, then
    `--tg` steps that decode one token for each of B sequences; step = T_TG / TG);
  - the floor: a step's FLOPs at the peak GEMM rate and its bytes (weights as stored, and the
    K/V it reads) at the read bandwidth, both measured in this run (engine_speed.py's roofline),
    taking the larger, as if one were entirely hidden behind the other.
Engines alternate per round (one at a time: the machine has two cores); medians are printed.

    .venv/bin/python benchmarks/engine/decode_scaling.py [--rounds 3] [--json PATH]

llama-batched-bench is built into serving/llama_server_build.py's cache folder (seconds where
llama-server was built there before; ~15 min from nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info, cpu_model  # noqa: E402
from benchmarks.engine.engine_speed import (DECODE_CONTEXT, MODEL, ModelCost,  # noqa: E402
                                            Roofline, bench_decode, make_engine,
                                            measure_roofline)
from benchmarks.serving.llama_server_build import DEFAULT_CACHE, build  # noqa: E402

from chunkserve.model.factory import LoadedModel, load_model  # noqa: E402

BATCHES = (1, 8, 32, 64)
PREFILL_BUDGET = 4096
TARGETS = {32: 2.5, 64: 3.0}  # issue 11: step(B) <= ratio x step(1)


@dataclass
class Row:
    batch: int
    chunkserve_ms: float
    llama_cpp_ms: float
    floor_ms: float  # max(FLOPs / peak GEMM rate, bytes / read bandwidth)


def parse_batched_bench(text: str) -> dict[int, float]:
    """{B: ms per decode step} from llama-batched-bench's table (PP | TG | B | N_KV | T_PP s |
    S_PP t/s | T_TG s | S_TG t/s | T s | S t/s)."""
    steps = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            tg, batch, t_tg = int(cells[1]), int(cells[2]), float(cells[6])
            steps[batch] = t_tg / tg * 1e3
    return steps


def run_llama_cpp(binary: str, gguf: str, batches: tuple[int, ...], tg: int) -> dict[int, float]:
    # Each sequence gets its own stream of ctx / max(B) cells: room for the prompt, the TG
    # tokens and the dummy token that applies the prompt's copy.
    ctx = max(batches) * (DECODE_CONTEXT + tg + 16)
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-npp", str(DECODE_CONTEXT), "-ntg", str(tg),
           "-npl", ",".join(map(str, batches)), "-pps", "-t", str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    steps = parse_batched_bench(done.stdout + done.stderr)
    if set(steps) != set(batches):
        raise RuntimeError(f"llama-batched-bench printed no row for some of {batches}:\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return steps


def run_chunkserve(loaded: LoadedModel, batches: tuple[int, ...], steps: int) -> dict[int, float]:
    # engine_speed's budget (its largest prefill): the B prompts are in within a few steps.
    engine, max_tokens = make_engine(loaded, (PREFILL_BUDGET,), batches, steps)
    try:
        results = bench_decode(engine, ModelCost.of(loaded), batches, steps, max_tokens)
    finally:
        engine.close()
    return {r.size: r.seconds * 1e3 for r in results}


def floors(cost: ModelCost, roof: Roofline, batches: tuple[int, ...], tg: int) -> dict[int, float]:
    ctx = DECODE_CONTEXT + tg // 2  # the mean context of the measured steps, about
    return {b: 1e3 * max(cost.decode_flops(b, b * ctx) / (roof.peak_gflops * 1e9),
                         cost.decode_bytes(b * ctx) / (roof.read_gbs * 1e9)) for b in batches}


def table(rows: list[Row]) -> str:
    one = rows[0]
    lines = ["| B | chunkserve ms/step | x its B=1 | llama.cpp ms/step | x its B=1 | floor ms | "
             "x floor B=1 | floor / chunkserve's B=1 | target |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        target = f"<= {TARGETS[r.batch]}x" if r.batch in TARGETS else ""
        lines.append(f"| {r.batch} | {r.chunkserve_ms:.1f} | "
                     f"{r.chunkserve_ms / one.chunkserve_ms:.1f} | {r.llama_cpp_ms:.1f} | "
                     f"{r.llama_cpp_ms / one.llama_cpp_ms:.1f} | {r.floor_ms:.1f} | "
                     f"{r.floor_ms / one.floor_ms:.1f} | {r.floor_ms / one.chunkserve_ms:.1f} | "
                     f"{target} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="engine runs each, alternating")
    p.add_argument("--steps", type=int, default=16, help="measured decode steps per batch size")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="llama.cpp build cache")
    p.add_argument("--json", help="also write the rows, the roofline and the host here")
    args = p.parse_args()
    start = time.perf_counter()
    print(cpu_model(), flush=True)
    binary = build(args.cache_dir, target="llama-batched-bench")
    loaded = load_model(MODEL, "auto", max_model_len=PREFILL_BUDGET + 512, quantization="auto")
    roof = measure_roofline(loaded, loaded.model.dtype, repeats=3)
    ours: dict[int, list[float]] = {b: [] for b in BATCHES}
    theirs: dict[int, list[float]] = {b: [] for b in BATCHES}
    for r in range(args.rounds):
        for b, ms in run_llama_cpp(binary, loaded.path, BATCHES, args.steps).items():
            theirs[b].append(ms)
        for b, ms in run_chunkserve(loaded, BATCHES, args.steps).items():
            ours[b].append(ms)
        print(f"round {r + 1}: llama.cpp {[round(theirs[b][-1], 1) for b in BATCHES]} ms, "
              f"chunkserve {[round(ours[b][-1], 1) for b in BATCHES]} ms", flush=True)
    floor = floors(ModelCost.of(loaded), roof, BATCHES, args.steps)
    rows = [Row(b, statistics.median(ours[b]), statistics.median(theirs[b]), floor[b])
            for b in BATCHES]
    elapsed = time.perf_counter() - start
    print(f"\nMachine: {cpu_model()}; roofline {roof.peak_gflops:.0f} GFLOP/s, "
          f"{roof.read_gbs:.1f} GB/s read; {args.rounds} rounds, medians.  \n"
          f"Command: `{shlex.join(['python', *sys.argv])}` ({elapsed:.0f} s)\n\n{table(rows)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"host": cpu_info(), "roofline": asdict(roof),
                       "rows": [asdict(r) for r in rows], "rounds": args.rounds,
                       "steps": args.steps,
                       "samples": {"chunkserve": ours, "llama.cpp": theirs}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
