"""What the served comparisons share (compare_llama_server.py, compare_vllm_cpu.py, dp_capacity.py,
stale_fit_served.py): a server started fresh on a free loopback port, one `chunkserve bench
serve` run against it with the article's mixed workload, the server stopped; and the markdown
table that sets two engines side by side."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

WORKLOAD = ["--dataset-name", "mixed", "--seed", "0", "--ignore-eos"]
# What the table shows, in order: (label, bench serve JSON key, unit scale).
ROWS = [
    ("capacity (req/s)", "request_throughput", 1.0),
    ("output tok/s", "output_throughput", 1.0),
    ("TTFT p50 (ms)", "median_ttft_ms", 1.0),
    ("TTFT p99 (ms)", "p99_ttft_ms", 1.0),
    ("ITL p50 (ms)", "median_itl_ms", 1.0),
    ("ITL p99 (ms)", "p99_itl_ms", 1.0),
    ("max token gap (ms)", "max_itl_ms", 1.0),
    ("TPOT p99 (ms)", "p99_tpot_ms", 1.0),
    ("E2E p50 (ms)", "median_e2el_ms", 1.0),
    ("failed requests", "failed", 1.0),
]
CLOSED_LOOP = ["--max-concurrency", "16", "--request-rate", "inf"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server on port {port} not healthy after {timeout:.0f} s")


def bench(engine: str, port: int, out_dir: str, name: str, traffic: Sequence[str],
          num_prompts: int, model: str, tokenizer: str | None = None) -> dict[str, Any]:
    """One `chunkserve bench serve` run; returns its saved result JSON. `model`: the name the
    requests carry; `tokenizer`: what the client counts tokens with (default: `model`)."""
    filename = f"{engine}-{name}.json"
    cmd = [sys.executable, "-m", "chunkserve.cli", "bench", "serve", "--port", str(port),
           "--model", model, "--tokenizer", tokenizer or model, *WORKLOAD,
           "--num-prompts", str(num_prompts), *traffic, "--metric-percentiles", "50,99",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir",
           out_dir, "--result-filename", filename, "--disable-tqdm"]
    subprocess.run(cmd, check=True)
    with open(os.path.join(out_dir, filename)) as f:
        result = json.load(f)
    result["command"] = " ".join(cmd[1:])
    return result


def measure_server(engine: str, command: Sequence[str], port: int, out_dir: str, name: str,
                   traffic: Sequence[str], num_prompts: int, model: str,
                   env: Mapping[str, str] | None = None, tokenizer: str | None = None,
                   health_timeout: float = 300.0) -> dict[str, Any]:
    """Starts `command` (a server on `port`), runs one bench, stops it; its log is
    OUT_DIR/ENGINE-NAME.log."""
    log = open(os.path.join(out_dir, f"{engine}-{name}.log"), "w")
    proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                            env=None if env is None else dict(env))
    try:
        wait_healthy(port, proc, health_timeout)
        return bench(engine, port, out_dir, name, traffic, num_prompts, model, tokenizer)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def failed_count(result: dict[str, Any]) -> int:
    return int(result["num_prompts"]) - int(result["completed"])


def side_by_side(results: dict[str, dict[str, dict[str, Any]]], engines: Sequence[str],
                 rate_from: str | None = None) -> str:
    """The markdown table: one section per phase, one column per engine, first / second.
    `rate_from`: the engine whose capacity set the open loop's rate (default: the second)."""
    first_name, second = engines
    lines = []
    for phase, title in (("capacity", "closed loop, 16 concurrent"),
                         ("open-loop", f"open loop at 70% of {rate_from or second}'s capacity")):
        first = results[first_name][phase]
        lines += [f"**{phase}** ({title}, {first['num_prompts']} requests"
                  + (f", {first['request_rate']} req/s" if phase == "open-loop" else "") + ")", "",
                  f"| metric | {first_name} | {second} | {first_name} / {second} |",
                  "|---|---:|---:|---:|"]
        for label, key, scale in ROWS:
            a, b = (results[e][phase].get(key) for e in engines)
            if a is None or b is None:
                continue
            ratio = f"{a / b:.2f}" if b else "–"
            lines.append(f"| {label} | {a * scale:,.3f} | {b * scale:,.3f} | {ratio} |"
                         if key == "request_throughput" else
                         f"| {label} | {a * scale:,.1f} | {b * scale:,.1f} | {ratio} |")
        lines.append("")
    return "\n".join(lines)
