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
With --prefill-sizes, the same rounds also time one prefill chunk of each size (a request
whose whole prompt is one step) beside llama.cpp's `llama-bench -p N -n 0` on the same file.
Engines alternate per round (one at a time: the machine has two cores); medians are printed.

    .venv/bin/python benchmarks/engine/decode_scaling.py [--rounds 3] [--json PATH]
        [--model FILE.gguf] [--batches 1,8,32] [--prefill-sizes 512,2048]

`--model` takes any GGUF, e.g. one `chunkserve export-dummy llama-3.2-3b --format gguf --quant
q4_0` wrote (issue 54). Before loading anything the run adds up what each engine will hold and
stops, saying why, if that is more than this machine has available (common/memory_fit.py).

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
from benchmarks.common.memory_fit import (chunkserve_gguf_parts, dense_copy_note,  # noqa: E402
                                          kv_bytes_per_token, llama_cpp_parts, require_fit)
from benchmarks.engine.engine_speed import (DECODE_CONTEXT, MODEL, ModelCost,  # noqa: E402
                                            bench_prefill,
                                            Roofline, bench_decode, make_engine,
                                            measure_roofline)
from benchmarks.serving.llama_server_build import DEFAULT_CACHE, build  # noqa: E402

from chunkserve.model.factory import LoadedModel, load_model, weight_formats  # noqa: E402
from chunkserve.model.loaders.source import resolve_model_path  # noqa: E402

BATCHES = (1, 8, 32, 64)
PREFILL_BUDGET = 4096
TARGETS = {32: 2.5, 64: 3.0}  # issue 11: step(B) <= ratio x step(1)


@dataclass
class Row:
    batch: int
    chunkserve_ms: float
    llama_cpp_ms: float
    floor_ms: float  # max(FLOPs / peak GEMM rate, bytes / read bandwidth)


@dataclass
class PrefillRow:
    tokens: int
    chunkserve_tok_s: float
    llama_cpp_tok_s: float


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


def llama_cpp_ctx(batches: tuple[int, ...], tg: int) -> int:
    # Each sequence gets its own stream of ctx / max(B) cells: room for the prompt, the TG
    # tokens and the dummy token that applies the prompt's copy.
    return max(batches) * (DECODE_CONTEXT + tg + 16)


def run_llama_cpp(binary: str, gguf: str, batches: tuple[int, ...], tg: int) -> dict[int, float]:
    cmd = [binary, "-m", gguf, "-c", str(llama_cpp_ctx(batches, tg)), "-npp", str(DECODE_CONTEXT),
           "-ntg", str(tg), "-npl", ",".join(map(str, batches)), "-pps",
           "-t", str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    steps = parse_batched_bench(done.stdout + done.stderr)
    if set(steps) != set(batches):
        raise RuntimeError(f"llama-batched-bench printed no row for some of {batches}:\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return steps


def parse_llama_bench(text: str) -> dict[int, float]:
    """{N: tokens/s} of llama-bench's `-o json` prompt tests (n_gen 0)."""
    return {int(t["n_prompt"]): float(t["avg_ts"]) for t in json.loads(text) if not t["n_gen"]}


def run_llama_bench(binary: str, gguf: str, sizes: tuple[int, ...]) -> dict[int, float]:
    """{N: tokens/s} of llama-bench's prompt-processing tests (-p N -n 0, one repetition: the
    rounds repeat it), on the threads chunkserve uses."""
    cmd = [binary, "-m", gguf, "-p", ",".join(map(str, sizes)), "-n", "0", "-r", "1",
           "-t", str(torch.get_num_threads()), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rates = parse_llama_bench(done.stdout)
    if set(rates) != set(sizes):
        raise RuntimeError(f"llama-bench printed no test for some of {sizes}:\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return rates


def run_chunkserve(loaded: LoadedModel, batches: tuple[int, ...], steps: int,
                   prefill_sizes: tuple[int, ...]) -> tuple[dict[int, float], dict[int, float]]:
    """({B: ms per decode step}, {N: prefill tokens/s}) of one fresh engine."""
    # engine_speed's budget (its largest prefill): the B prompts are in within a few steps.
    engine, max_tokens = make_engine(loaded, (PREFILL_BUDGET,), batches, steps)
    cost = ModelCost.of(loaded)
    try:
        decode = bench_decode(engine, cost, batches, steps, max_tokens)
        prefill = bench_prefill(engine, cost, prefill_sizes, repeats=1) if prefill_sizes else []
    finally:
        engine.close()
    return {r.size: r.seconds * 1e3 for r in decode}, {r.size: r.tok_s for r in prefill}


def floors(cost: ModelCost, roof: Roofline, batches: tuple[int, ...], tg: int) -> dict[int, float]:
    ctx = DECODE_CONTEXT + tg // 2  # the mean context of the measured steps, about
    return {b: 1e3 * max(cost.decode_flops(b, b * ctx) / (roof.peak_gflops * 1e9),
                         cost.decode_bytes(b * ctx) / (roof.read_gbs * 1e9)) for b in batches}


def table(rows: list[Row]) -> str:
    one = rows[0]
    lines = ["| B | chunkserve ms/step | x its B=1 | llama.cpp ms/step | x its B=1 | floor ms | "
             "x floor B=1 | floor / chunkserve's B=1 | chunkserve / llama.cpp | target |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        target = f"<= {TARGETS[r.batch]}x" if r.batch in TARGETS else ""
        lines.append(f"| {r.batch} | {r.chunkserve_ms:.1f} | "
                     f"{r.chunkserve_ms / one.chunkserve_ms:.1f} | {r.llama_cpp_ms:.1f} | "
                     f"{r.llama_cpp_ms / one.llama_cpp_ms:.1f} | {r.floor_ms:.1f} | "
                     f"{r.floor_ms / one.floor_ms:.1f} | {r.floor_ms / one.chunkserve_ms:.1f} | "
                     f"{r.chunkserve_ms / r.llama_cpp_ms:.2f} | {target} |")
    return "\n".join(lines)


def prefill_table(rows: list[PrefillRow]) -> str:
    lines = ["| prefill chunk (tokens) | chunkserve tok/s | llama.cpp tok/s | "
             "chunkserve / llama.cpp |", "|---:|---:|---:|---:|"]
    lines += [f"| {r.tokens} | {r.chunkserve_tok_s:.0f} | {r.llama_cpp_tok_s:.0f} | "
              f"{r.chunkserve_tok_s / r.llama_cpp_tok_s:.2f} |" for r in rows]
    return "\n".join(lines)


def sizes(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL, help="the GGUF both engines run (default: SmolLM2)")
    p.add_argument("--batches", type=sizes, default=BATCHES, help="decode batch sizes, e.g. 1,8,32")
    p.add_argument("--prefill-sizes", type=sizes, default=(),
                   help="also time a prefill chunk of each size, e.g. 512,2048")
    p.add_argument("--rounds", type=int, default=3, help="engine runs each, alternating")
    p.add_argument("--steps", type=int, default=16, help="measured decode steps per batch size")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="llama.cpp build cache")
    p.add_argument("--json", help="also write the rows, the roofline and the host here")
    args = p.parse_args()
    if not args.batches or min(args.batches) != 1:
        p.error("--batches must include 1 (every ratio is to B=1)")
    if any(n > PREFILL_BUDGET for n in args.prefill_sizes):
        p.error(f"--prefill-sizes: at most {PREFILL_BUDGET} tokens (one step of the engine)")
    try:
        args.gguf = resolve_model_path(args.model)
    except ValueError as e:
        p.error(str(e))
    if not args.gguf.endswith(".gguf"):
        p.error(f"--model {args.model!r} is not a GGUF file, which llama.cpp needs")
    return args


def check_memory(gguf: str, batches: tuple[int, ...], steps: int) -> None:
    """Refuses the run, before loading, if either engine would not fit (one runs at a time)."""
    per_token = kv_bytes_per_token(gguf)
    tokens = llama_cpp_ctx(batches, steps)
    name = os.path.basename(gguf)
    ours = chunkserve_gguf_parts(gguf, per_token * tokens)
    require_fit(f"chunkserve on {name}", ours)
    note = dense_copy_note(gguf, ours)
    if note:
        print(note, flush=True)
    require_fit(f"llama.cpp on {name}", llama_cpp_parts(gguf, per_token * tokens))


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    print(cpu_model(), flush=True)
    check_memory(args.gguf, args.batches, args.steps)
    binary = build(args.cache_dir, target="llama-batched-bench")
    bench_binary = build(args.cache_dir, target="llama-bench") if args.prefill_sizes else ""
    loaded = load_model(args.gguf, "auto", max_model_len=PREFILL_BUDGET + 512, quantization="auto")
    roof = measure_roofline(loaded, loaded.model.dtype, repeats=3)
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        e: {"decode_ms": {b: [] for b in args.batches},
            "prefill_tok_s": {n: [] for n in args.prefill_sizes}}
        for e in ("chunkserve", "llama.cpp")}
    theirs, ours = samples["llama.cpp"], samples["chunkserve"]
    for r in range(args.rounds):
        for b, ms in run_llama_cpp(binary, args.gguf, args.batches, args.steps).items():
            theirs["decode_ms"][b].append(ms)
        if args.prefill_sizes:
            for n, rate in run_llama_bench(bench_binary, args.gguf, args.prefill_sizes).items():
                theirs["prefill_tok_s"][n].append(rate)
        decode, prefill = run_chunkserve(loaded, args.batches, args.steps, args.prefill_sizes)
        for b, ms in decode.items():
            ours["decode_ms"][b].append(ms)
        for n, rate in prefill.items():
            ours["prefill_tok_s"][n].append(rate)
        print(f"round {r + 1}: llama.cpp {[round(theirs['decode_ms'][b][-1], 1) for b in args.batches]}"
              f" ms, chunkserve {[round(ours['decode_ms'][b][-1], 1) for b in args.batches]} ms",
              flush=True)
    report(args, loaded, roof, samples, time.perf_counter() - start)
    return 0


def report(args: argparse.Namespace, loaded: LoadedModel, roof: Roofline,
           samples: dict[str, dict[str, dict[int, list[float]]]], elapsed: float) -> None:
    med = {e: {k: {n: statistics.median(v) for n, v in d.items()} for k, d in s.items()}
           for e, s in samples.items()}
    floor = floors(ModelCost.of(loaded), roof, args.batches, args.steps)
    rows = [Row(b, med["chunkserve"]["decode_ms"][b], med["llama.cpp"]["decode_ms"][b], floor[b])
            for b in args.batches]
    pre = [PrefillRow(n, med["chunkserve"]["prefill_tok_s"][n], med["llama.cpp"]["prefill_tok_s"][n])
           for n in args.prefill_sizes]
    print(f"\nMachine: {cpu_model()}; roofline {roof.peak_gflops:.0f} GFLOP/s, "
          f"{roof.read_gbs:.1f} GB/s read; {args.rounds} rounds, medians. Model "
          f"{os.path.basename(args.gguf)}; chunkserve's linears: {weight_formats(loaded.model)}.  \n"
          f"Command: `{shlex.join(['python', *sys.argv])}` ({elapsed:.0f} s)\n\n{table(rows)}"
          + (f"\n\n{prefill_table(pre)}" if pre else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"host": cpu_info(), "model": os.path.basename(args.gguf),
                       "roofline": asdict(roof), "rows": [asdict(r) for r in rows],
                       "prefill": [asdict(r) for r in pre], "rounds": args.rounds,
                       "steps": args.steps, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
