"""One call on a CUDA machine: is chunkserve correct there, how fast is it, does chunking show?

    python benchmarks/gpu/gpu_check.py --out DIR           # on a GPU; under 8 minutes
    python benchmarks/gpu/gpu_check.py --out DIR --smoke   # on the CPU: tests the script

Sections, each timed and recorded even if an earlier one failed:
  (a) correctness on the device: `pytest tests/test_cuda.py tests/test_triton_attention.py`
      (HF-transformers parity, token identity across budgets/policies/preemption, CUDA graphs
      vs eager, Triton vs torch attention);
  (b) speed of `llama-3-8b` with dummy weights: prefill tok/s and decode ms/step (B=1/32/128,
      eager and CUDA graphs) against a bf16 matmul and HBM-bandwidth roofline of the same run;
  (c) a short `bench sweep` of the mixed workload over chunk sizes none/256/512/2048/8192.
It writes at most 8 files to --out: summary.json, summary.md, pytest.log and the sweep's
results.json, table.md and three plots. Needs only this repository and its runtime
dependencies (no model download: dummy weights, the tokenizer bundled in chunkserve).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# engine_speed's prefill and decode loops are reused as they are.
from benchmarks.common.report import save_report  # noqa: E402
from benchmarks.engine import engine_speed  # noqa: E402

from chunkserve.cli import main as chunkserve_main  # noqa: E402
from chunkserve.model.factory import load_model  # noqa: E402

BUDGET_S = 8 * 60
TARGETS = {  # issue 10's targets on an H200 (llama-3-8b, bf16)
    "decode_B1_ms": 8.0, "decode_B32_ms": 12.0, "decode_B128_ms": 25.0,
    "prefill_matmul_fraction": 0.65, "capacity_req_s": 20.0, "step_overhead_share": 0.30,
}


def profile(smoke: bool) -> dict[str, Any]:
    """What each section runs: the real sizes on a GPU, tiny ones for the CPU smoke test."""
    if smoke:
        return dict(model="tiny-llama", device="cpu", prefill=(64, 256), batches=(1, 4),
                    decode_steps=3, max_model_len=1024, sweep_prompts=12,
                    sweep_flags=["--mixed-long-input-range", "256:512",
                                 "--mixed-short-input-range", "16:64",
                                 "--mixed-output-range", "4:8", "--chunk-sizes", "none,64,256"])
    return dict(model="llama-3-8b", device="cuda", prefill=(512, 2048, 8191),
                batches=(1, 32, 128), decode_steps=10, max_model_len=8192, sweep_prompts=200,
                sweep_flags=["--chunk-sizes", "none,256,512,2048,8192", "--kv-cache-memory", "40"])


# ---- (0) where we are --------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu": engine_speed.cpu_model(), "cuda": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda_runtime=torch.version.cuda)
    return info


# ---- (a) correctness ---------------------------------------------------------------------------
def correctness(out_dir: str, smoke: bool) -> dict[str, Any]:
    files = ["tests/test_triton_attention.py"] if smoke else [
        "tests/test_cuda.py", "tests/test_triton_attention.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    with open(os.path.join(out_dir, "pytest.log"), "w") as f:
        f.write(log)
    last = log.strip().splitlines()[-1] if log.strip() else ""
    return {"command": " ".join(cmd[1:]), "exit_code": proc.returncode, "result": last}


# ---- (b) speed ---------------------------------------------------------------------------------
def _time_cuda(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median seconds of `fn` by CUDA events (by wall clock on the CPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def roofline(device: str, hidden: int, inter: int, smoke: bool) -> dict[str, float]:
    """bf16 matmul TFLOP/s on the model's MLP shape at 8192 tokens; copy and read GB/s."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = 512 if smoke else 8192
    a = torch.randn(tokens, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, inter, device=device, dtype=dtype)
    matmul_s = _time_cuda(lambda: a @ b)
    n = (64 if smoke else 4096) * 2**20 // 4  # float32 elements, far beyond any cache
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src))
    read_s = _time_cuda(lambda: src.sum())
    return {"matmul_tflops": 2 * tokens * hidden * inter / matmul_s / 1e12,
            "copy_gbs": 2 * n * 4 / copy_s / 1e9, "read_gbs": n * 4 / read_s / 1e9}


def speed(prof: dict[str, Any]) -> dict[str, Any]:
    loaded = load_model(prof["model"], "auto", prof["max_model_len"], prof["device"],
                        load_format="dummy")
    cfg = loaded.config
    roof = roofline(prof["device"], cfg.hidden_size, cfg.intermediate_size, "tiny" in prof["model"])
    cost = engine_speed.ModelCost.of(loaded)
    engine_speed.DECODE_CONTEXT = 512
    report: dict[str, Any] = {"model": prof["model"], "dtype": str(loaded.model.dtype),
                              "roofline": roof, "weight_gb": cost.weight_bytes / 1e9}
    for mode, eager in (("eager", True), ("graphs", False)):
        engine, max_tokens = engine_speed.make_engine(
            loaded, prof["prefill"], prof["batches"], prof["decode_steps"], enforce_eager=eager)
        if mode == "eager":  # CUDA graphs only replay decode steps: prefill once is enough
            prefill = engine_speed.bench_prefill(engine, cost, prof["prefill"], repeats=3)
            report["prefill"] = [
                {"tokens": r.size, "ms": r.seconds * 1e3, "tok_s": r.tok_s,
                 "matmul_fraction": r.gflops / 1e3 / roof["matmul_tflops"]} for r in prefill]
        decode = engine_speed.bench_decode(engine, cost, prof["batches"], prof["decode_steps"],
                                           max_tokens)
        report[f"decode_{mode}"] = [
            {"batch": r.size, "context": r.context, "ms": r.seconds * 1e3,
             "read_bw_fraction": r.gbs / roof["read_gbs"]} for r in decode]
        graphs = engine.executor.graphs
        report[f"graph_replays_{mode}"] = 0 if graphs is None else graphs.num_replays
        engine.close()
        del engine
    del loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


# ---- (c) chunk-size sweep ----------------------------------------------------------------------
def sweep(prof: dict[str, Any], out_dir: str) -> dict[str, Any]:
    folder = os.path.join(out_dir, "sweep")
    argv = ["bench", "sweep", "--model", prof["model"], "--device", prof["device"],
            "--dataset-name", "mixed", "--num-prompts", str(prof["sweep_prompts"]),
            "--load", "0.7", "--max-model-len", str(prof["max_model_len"]), "--out", folder,
            *prof["sweep_flags"]]
    code = chunkserve_main(argv)
    with open(os.path.join(folder, "results.json")) as f:
        entries = json.load(f)
    keys = ("chunk_size", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms",
            "p99_itl_ms", "max_itl_ms", "mean_step_ms", "step_overhead_share", "num_preemptions")
    points = [{k: e.get(k) for k in keys} for e in entries]
    rate = float(entries[0]["request_rate"])
    return {"command": "chunkserve " + " ".join(argv), "exit_code": code,
            "capacity_req_s": rate / 0.7, "points": points}


# ---- summary -----------------------------------------------------------------------------------
def verdicts(report: dict[str, Any]) -> dict[str, Any]:
    """Each target with its measured value and whether it was met (None: not measured)."""
    out: dict[str, Any] = {}
    sp, sw = report.get("speed") or {}, report.get("sweep") or {}
    for row in sp.get("decode_graphs", []):
        key = f"decode_B{row['batch']}_ms"
        if key in TARGETS:
            out[key] = (row["ms"], row["ms"] <= TARGETS[key])
    prefill = sp.get("prefill", [])
    if prefill:
        frac = prefill[-1]["matmul_fraction"]
        out["prefill_matmul_fraction"] = (frac, frac >= TARGETS["prefill_matmul_fraction"])
    if sw.get("points"):
        out["capacity_req_s"] = (sw["capacity_req_s"],
                                 sw["capacity_req_s"] >= TARGETS["capacity_req_s"])
        at_2048 = [p for p in sw["points"] if p["chunk_size"] == 2048] or sw["points"][-1:]
        share = at_2048[0]["step_overhead_share"]
        out["step_overhead_share"] = (share, share <= TARGETS["step_overhead_share"])
    return out


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# gpu_check: {env.get('gpu', env['cpu'])}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; "
             f"{report['elapsed_s']:.0f} s.", ""]
    for name in ("correctness", "speed", "sweep"):
        if name in report.get("errors", {}):
            lines.append(f"- **{name} failed**: `{report['errors'][name].splitlines()[-1]}`")
    c = report.get("correctness")
    if c:
        lines.append(f"- tests: `{c['result']}` (exit {c['exit_code']})")
    sp = report.get("speed")
    if sp:
        r = sp["roofline"]
        lines += [f"- roofline: matmul {r['matmul_tflops']:.0f} TFLOP/s, copy {r['copy_gbs']:.0f} "
                  f"GB/s, read {r['read_gbs']:.0f} GB/s; weights {sp['weight_gb']:.2f} GB", ""]
        lines += ["| prefill tokens | ms | tok/s | % matmul |", "|---:|---:|---:|---:|"]
        lines += [f"| {p['tokens']} | {p['ms']:.1f} | {p['tok_s']:.0f} | "
                  f"{p['matmul_fraction']:.0%} |" for p in sp["prefill"]]
        lines += ["", "| decode B | ctx | eager ms | graphs ms | graphs % read BW |",
                  "|---:|---:|---:|---:|---:|"]
        for e, g in zip(sp["decode_eager"], sp["decode_graphs"]):
            lines.append(f"| {e['batch']} | {e['context']:.0f} | {e['ms']:.2f} | {g['ms']:.2f} | "
                         f"{g['read_bw_fraction']:.0%} |")
        lines.append("")
    sw = report.get("sweep")
    if sw:
        lines += [f"- sweep: capacity {sw['capacity_req_s']:.2f} req/s; `{sw['command']}`", "",
                  "| chunk | req/s | TTFT p50 | TPOT p99 | ITL p99 | max gap | step ms | "
                  "overhead share |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for p in sw["points"]:
            lines.append(
                f"| {p['chunk_size']} | {p['request_throughput']:.2f} | {p['median_ttft_ms']:.0f}"
                f" | {p['p99_tpot_ms']:.1f} | {p['p99_itl_ms']:.1f} | {p['max_itl_ms']:.0f} | "
                f"{p['mean_step_ms']:.1f} | {p['step_overhead_share']:.0%} |")
        lines.append("")
    lines += ["| target | measured | met |", "|---|---:|---|"]
    for key, (value, ok) in report["targets"].items():
        lines.append(f"| {key} {'<=' if key.endswith(('ms', 'share')) else '>='} "
                     f"{TARGETS[key]} | {value:.3g} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU: checks the script")
    p.add_argument("--skip", nargs="*", default=[], choices=["correctness", "speed", "sweep"])
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; use --smoke to exercise the script on the CPU")
        return 2
    os.makedirs(args.out, exist_ok=True)
    prof = profile(args.smoke)
    start = time.monotonic()
    report: dict[str, Any] = {"environment": environment(), "errors": {}, "seconds": {}}
    print(json.dumps(report["environment"]), flush=True)
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("correctness", lambda: correctness(args.out, args.smoke)),
        ("speed", lambda: speed(prof)),
        ("sweep", lambda: sweep(prof, args.out)),
    ]
    for name, run in sections:
        if name in args.skip:
            continue
        if time.monotonic() - start > BUDGET_S:
            report["errors"][name] = "skipped: the 8-minute budget was spent"
            continue
        t0 = time.monotonic()
        print(f"== {name} ==", flush=True)
        try:
            report[name] = run()
        except Exception:  # one broken section must not cost the others' results
            report["errors"][name] = traceback.format_exc()
            print(report["errors"][name], flush=True)
        report["seconds"][name] = round(time.monotonic() - t0, 1)
    report["elapsed_s"] = time.monotonic() - start
    report["targets"] = verdicts(report)
    save_report(args.out, "summary", report, markdown(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
