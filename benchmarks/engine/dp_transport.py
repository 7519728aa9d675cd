"""What the data-parallel transport costs a step: two engine processes of tiny-llama (`-dp 2`),
driven by the front end's own clients, with no HTTP in the way (issue 52).

Two figures, each the median over both engines:
- **step event latency**: from the end of a step in the engine process (its record's
  start + duration, on CLOCK_MONOTONIC, which every process of the host shares) to the moment
  the front end's handler holds that step's event: the loop's flush, encoding, the socket or
  queue, decoding and dispatch. Every decode step of --requests requests per engine counts.
- **command round trip**: a ResetPrefixCache command to an idle engine and its answer back,
  --pings times per engine, one at a time.

`--compare PATH` also runs the same measurement against another checkout (say a `git
worktree` of the commit before a transport change), alternating the two --rounds times in
this one run, so that a neighbour's burst spoils a round, not a column.

    .venv/bin/python benchmarks/engine/dp_transport.py [--compare /tmp/before] [--rounds 3]
        [--requests 16 --prompt-len 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _clients_api() -> tuple[Any, ...]:
    """start_engines and the loop's command types, wherever this checkout keeps them."""
    try:
        from chunkserve.engine.engine_loop import Add, ResetPrefixCache
        from chunkserve.frontend.engines import start_engines
    except ImportError:  # the layout before issue 52
        from chunkserve.serve.engine_loop import Add, ResetPrefixCache  # type: ignore
        from chunkserve.serve.engine_proc import start_engines  # type: ignore
    return start_engines, Add, ResetPrefixCache


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One measurement in this process: start the engines, time steps and pings, stop."""
    from chunkserve.config import EngineConfig
    from chunkserve.sampling_params import SamplingParams

    start_engines, Add, ResetPrefixCache = _clients_api()
    config = EngineConfig.from_kwargs(model=args.model, data_parallel_size=2,
                                      max_num_batched_tokens=64, max_num_seqs=16)
    clients = start_engines(config)
    latencies: list[float] = []
    answers: dict[int, threading.Event] = {}
    done = threading.Semaphore(0)

    def handle(index: int, ev: Any) -> None:
        now = time.monotonic()
        if ev.record is not None and ev.record.num_prefill_tokens == 0:
            latencies.append(now - ev.record.start - ev.record.duration)
        for token, _ in ev.reset_answers:
            answers.pop(token).set()
        for _rid, out, _new in ev.outputs:
            if getattr(out, "finished", True):
                done.release()

    try:
        for c in clients:
            c.start(handle)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for c in clients:
            for r in range(args.requests):
                processor = c.info.processor if hasattr(c.info, "processor") else None
                prompt = [1 + r, *range(2, 1 + args.prompt_len)]  # distinct: no shared prefix
                req = processor.process_inputs(f"e{c.index}-r{r}", prompt, params)
                c.send(Add(req))
        for _ in range(len(clients) * args.requests):
            done.acquire(timeout=120)
        rtts: list[float] = []
        for i in range(args.pings):
            c = clients[i % len(clients)]
            answers[i] = ev = threading.Event()
            t0 = time.monotonic()
            c.send(ResetPrefixCache(i))
            ev.wait(10)
            rtts.append(time.monotonic() - t0)
    finally:
        for c in clients:
            c.shutdown(10.0)
    return {"step_event_latency_us": 1e6 * statistics.median(latencies),
            "step_event_latency_p90_us": 1e6 * sorted(latencies)[int(0.9 * len(latencies))],
            "num_steps": float(len(latencies)),
            "command_rtt_us": 1e6 * statistics.median(rtts)}


def run_checkout(path: str, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh interpreter that imports chunkserve from `path`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
           "--pings", str(args.pings), "--prompt-len", str(args.prompt_len)]
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(cmd, env=env, cwd=path, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--requests", type=int, default=4, help="decoding requests per engine")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=4,
                   help="prompt tokens per request (each step's outputs repeat them)")
    p.add_argument("--pings", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", help="another checkout, measured alternately in this run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    sys.path.insert(0, ROOT)
    from benchmarks.common.host import cpu_model

    print(f"# {cpu_model()}; {args.model}, -dp 2, {args.requests} decoding requests per engine, "
          f"{args.prompt_len}-token prompts, {args.max_tokens} output tokens")
    checkouts = {"this": ROOT, **({"compare": args.compare} if args.compare else {})}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            results[name].append(run_checkout(path, args))
            print(f"{name}: {results[name][-1]}", flush=True)
    print("| checkout | step event latency (median, us) | p90 (us) | command round trip (us) |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} ({checkouts[name]}) | {med['step_event_latency_us']:.0f} | "
              f"{med['step_event_latency_p90_us']:.0f} | {med['command_rtt_us']:.0f} |")


if __name__ == "__main__":
    main()
