"""chunkserve against llama.cpp's llama-server on this CPU: same GGUF, same client, one run.

Both engines serve the same GGUF (`--model`: SmolLM2 by default, or `gemma3-270m`, the file
of the PyPI packages) on free loopback ports, one at a time (the machine has two
cores; the other engine is stopped), each restarted fresh for every measurement, and
`chunkserve bench serve` drives them with the article's mixed workload (streaming, ignore_eos,
fixed seed, so the same prompts in the same order):
  1. capacity, closed loop: --max-concurrency 16, 48 requests, all queued at once;
  2. open loop at 70% of llama-server's measured capacity (Poisson arrivals), 30 requests.
It writes `comparison.json` (every bench serve result, the CPU, the commands) and
`comparison.md` (the side-by-side table) to --out.

    .venv/bin/python benchmarks/serving/compare_llama_server.py --out DIR [--model gemma3-270m]
        [--peer-args=--no-repack] [--workload-args='--mixed-output-range 16:64']

`--model` also takes a GGUF path, e.g. a 1-8B file of `chunkserve export-dummy` (issue 54);
`--workload-args` then scales the mixed workload down (bench serve's --mixed-* flags) so that
each phase ends in minutes on 2 cores. Before starting either server the run adds up what each
will hold and stops, saying why, if that is more than this machine has (common/memory_fit.py).

llama-server is built once into a cache folder by llama_server_build.py (~15 min on 2 cores).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info  # noqa: E402
from benchmarks.common.memory_fit import (GiB, chunkserve_gguf_parts,  # noqa: E402
                                          dense_copy_note, kv_bytes_per_token,
                                          llama_cpp_parts, require_fit)
from benchmarks.common.report import save_report  # noqa: E402
from benchmarks.serving import served  # noqa: E402
from benchmarks.serving.served import CLOSED_LOOP, failed_count, free_port, measure_server  # noqa: E402
from benchmarks.serving.llama_server_build import DEFAULT_CACHE, build  # noqa: E402

ENGINES = ("chunkserve", "llama-server")
PEER = "llama-server"  # the open-loop rate is set from its capacity
SLOTS, SLOT_TOKENS = 16, 4608  # room for the longest mixed request (4096 + 128) in every slot


def server_command(engine: str, port: int, gguf: str, binary: str | None,
                   extra_args: Sequence[str] = (), model: str = "smollm2-135m") -> list[str]:
    """The server's command line; `extra_args`: that engine's extra flags (none by default:
    chunkserve exactly as `make serve` runs it, for `model`, on another port)."""
    if engine == "chunkserve":
        return [sys.executable, "-m", "chunkserve.cli", "serve", "--model", model,
                "--host", "127.0.0.1", "--port", str(port), *extra_args]
    assert binary is not None
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(SLOTS), "-t", "2", "-c", str(SLOTS * SLOT_TOKENS), *extra_args]


def measure(engine: str, gguf: str, binary: str | None, out_dir: str, name: str,
            traffic: Sequence[str], num_prompts: int, extra_args: Sequence[str] = (),
            model: str = "smollm2-135m") -> dict[str, Any]:
    """Starts the engine fresh (with `extra_args`), runs one bench, stops it."""
    port = free_port()
    return measure_server(engine, server_command(engine, port, gguf, binary, extra_args, model),
                          port, out_dir, name, traffic, num_prompts, model)


def check_memory(gguf: str) -> None:
    """Refuses the run before either server starts if one would not fit (one runs at a time):
    chunkserve with its default 2 GiB KV pool, llama-server with its f16 cache of every slot."""
    from chunkserve.config import DEFAULT_KV_CACHE_GIB
    per_token = kv_bytes_per_token(gguf)
    name = os.path.basename(gguf)
    ours = chunkserve_gguf_parts(gguf, int(DEFAULT_KV_CACHE_GIB * GiB))
    require_fit(f"chunkserve serving {name}", ours)
    note = dense_copy_note(gguf, ours)
    if note:
        print(note, flush=True)
    require_fit(f"llama-server serving {name}",
                llama_cpp_parts(gguf, per_token * SLOTS * SLOT_TOKENS))


def side_by_side(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    return served.side_by_side(results, ENGINES)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", default=DEFAULT_CACHE)
    p.add_argument("--model", default="smollm2-135m",
                   help="a model name chunkserve resolves to a GGUF file (smollm2-135m, "
                        "gemma3-270m); llama-server serves that same file")
    p.add_argument("--capacity-prompts", type=int, default=48)
    p.add_argument("--open-loop-prompts", type=int, default=30)
    p.add_argument("--load", type=float, default=0.7, help="open-loop rate / peer's capacity")
    p.add_argument("--peer-args", default="",
                   help="extra llama-server flags as one string, e.g. --peer-args=--no-repack "
                        "(on a KVM host with AMX, llama.cpp's AMX matmul crashed at start-up on "
                        "2026-12-01; --no-repack keeps weights out of its AMX buffers)")
    p.add_argument("--chunkserve-args", default="",
                   help="extra `chunkserve serve` flags as one string, e.g. "
                        "--chunkserve-args='--kv-cache-dtype bfloat16' (default: none, the "
                        "server as `make serve` runs it)")
    p.add_argument("--workload-args", default="",
                   help="extra `bench serve` flags for both engines as one string, to scale the "
                        "mixed workload, e.g. '--mixed-long-input-range 1024:2048 "
                        "--mixed-output-range 16:64'")
    args = p.parse_args()
    peer_args = shlex.split(args.peer_args)
    extra = {PEER: peer_args, "chunkserve": shlex.split(args.chunkserve_args)}
    workload = shlex.split(args.workload_args)
    from chunkserve.model.loaders.source import resolve_model_path

    os.makedirs(args.out, exist_ok=True)
    try:
        gguf = resolve_model_path(args.model)
    except ValueError as e:
        p.error(str(e))
    if not gguf.endswith(".gguf"):
        p.error(f"--model {args.model!r} is not a GGUF file, which llama-server needs")
    check_memory(gguf)
    binary = build(args.cache_dir)
    started = time.time()
    results: dict[str, dict[str, dict[str, Any]]] = {e: {} for e in ENGINES}
    for engine in (PEER, "chunkserve"):
        results[engine]["capacity"] = measure(engine, gguf, binary, args.out, "capacity",
                                              CLOSED_LOOP + workload, args.capacity_prompts,
                                              extra[engine], args.model)
    rate = args.load * results[PEER]["capacity"]["request_throughput"]
    for engine in ENGINES:
        results[engine]["open-loop"] = measure(engine, gguf, binary, args.out, "open-loop",
                                               ["--request-rate", f"{rate:.4f}", *workload],
                                               args.open_loop_prompts, extra[engine],
                                               args.model)
    for engine in ENGINES:
        for result in results[engine].values():
            result["failed"] = failed_count(result)
    report = {"cpu": cpu_info(), "gguf": os.path.basename(gguf), "load": args.load,
              "peer_args": peer_args, "chunkserve_args": extra["chunkserve"],
              "workload_args": workload, "elapsed_s": round(time.time() - started),
              "results": results}
    cpu = report["cpu"]
    text = (f"# chunkserve vs llama-server on {cpu['model']} ({cpu['cores']} cores; "
            f"{' '.join(cpu['flags'])})\n\nModel {report['gguf']}; command "
            f"`{shlex.join(['python', *sys.argv])}` ({report['elapsed_s']} s).\n\n"
            + side_by_side(results))
    save_report(args.out, "comparison", report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
