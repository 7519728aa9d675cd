"""What the web page's live step stream (GET /engine/steps) costs the engine.

Issue 34 asks for nothing measurable when nobody watches and under 2% when someone does. Two
measurements:

1. per record, in this process: `StepStream.observe` with no subscriber (the engine thread's
   only extra work then), with one (a deque append), and the event loop's share of summarizing
   one record and sending it as JSON;
2. a real server under a decode-heavy load (short steps: the worst case for a per-step cost),
   in alternating phases without and with a subscriber reading the stream as the page does:
   the engine's mean step time (chunkserve:step_duration_seconds' sum / count over the phase)
   and the generated tokens per second; medians over the phases of each kind.

    .venv/bin/python benchmarks/engine/web_stream_cost.py [--model tiny-llama] [--rounds 4]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import timeit

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.host import cpu_model  # noqa: E402

from chunkserve.engine.trace import StepRecord  # noqa: E402
from chunkserve.serve.step_stream import StepStream, step_summary  # noqa: E402


def a_record() -> StepRecord:
    return StepRecord(step=1, start=1.0, duration=0.004, num_prefill_tokens=16,
                      num_decode_tokens=16, num_prefill_reqs=1, num_decode_reqs=16,
                      num_running=17, num_waiting=2, kv_usage=0.3, kv_blocks_used=40,
                      internal_fragmentation=100, num_preemptions=0, num_swapped_blocks=0,
                      token_budget=64, prefill_requests=[["cmpl-abc-0", 16, 32]])


def per_record_costs() -> dict[str, float]:
    """Nanoseconds per record."""
    n = 200_000
    rec, stream = a_record(), StepStream()
    costs = {"observe, nobody subscribed": timeit.timeit(lambda: stream.observe(rec), number=n)}

    async def subscribed() -> float:
        it = stream.summaries()
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # subscribed now
        t = timeit.timeit(lambda: stream.observe(rec), number=n)
        task.cancel()  # ends the generator: it unsubscribes
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return t

    costs["observe, one subscriber"] = asyncio.run(subscribed())
    costs["summary + JSON (event loop)"] = timeit.timeit(
        lambda: json.dumps(step_summary(rec, 0)), number=n)
    return {k: v / n * 1e9 for k, v in costs.items()}


class Server:
    def __init__(self, model: str, port: int, engine_cores: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "chunkserve.cli", "serve", model, "--port", str(port),
               "--uvicorn-log-level", "warning", "--max-model-len", "512"]
        # The engine's OpenMP pool on cores of its own: on a small shared host a pool that
        # competes with the clients (or another tenant) for every core stalls at each barrier,
        # and that noise would swamp what is measured here.
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": engine_cores}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("the server did not start")

    def counters(self) -> tuple[float, float, float]:
        """(step seconds, steps, generated tokens) so far."""
        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in ("chunkserve:step_duration_seconds_sum",
                        "chunkserve:step_duration_seconds_count", "vllm:generation_tokens_total"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return (values["chunkserve:step_duration_seconds_sum"],
                values["chunkserve:step_duration_seconds_count"],
                values["vllm:generation_tokens_total"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def load(url: str, stop: threading.Event, prompt_tokens: int, max_tokens: int) -> None:
    """One client: back-to-back requests, so the batch stays full of decodes."""
    body = {"prompt": [100 + i for i in range(prompt_tokens)], "max_tokens": max_tokens,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            http.post(url + "/v1/completions", json=body)


def watch(url: str, stop: threading.Event, seen: list[int]) -> None:
    """A page's reading of the stream: every summary parsed."""
    with httpx.Client(timeout=None) as http, http.stream("GET", url + "/engine/steps") as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen[0] += len(json.loads(line[6:]).get("steps", ()))
            if stop.is_set():
                return


def phase(server: Server, seconds: float, watched: bool) -> tuple[float, float]:
    """(mean step ms, generated tokens/s) over one phase."""
    stop, seen = threading.Event(), [0]
    watcher = threading.Thread(target=watch, args=(server.url, stop, seen), daemon=True)
    if watched:
        watcher.start()
        time.sleep(0.2)
    s0, n0, g0 = server.counters()
    t0 = time.monotonic()
    time.sleep(seconds)
    s1, n1, g1 = server.counters()
    elapsed = time.monotonic() - t0
    stop.set()
    if watched:
        watcher.join(10)
        assert seen[0] > 0, "the watcher saw no step"
    return (s1 - s0) / max(1.0, n1 - n0) * 1e3, (g1 - g0) / elapsed


def serving_costs(args: argparse.Namespace) -> None:
    server = Server(args.model, args.port, args.engine_cores)
    stop = threading.Event()
    clients = [threading.Thread(target=load, args=(server.url, stop, args.prompt_tokens,
                                                   args.max_tokens), daemon=True)
               for _ in range(args.concurrency)]
    try:
        for c in clients:
            c.start()
        phase(server, args.seconds, False)  # warm-up
        results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(args.rounds):
            for watched in ((False, True) if r % 2 == 0 else (True, False)):
                results[watched].append(phase(server, args.seconds, watched))
                step_ms, tok_s = results[watched][-1]
                print(f"  round {r} {'watched  ' if watched else 'unwatched'} "
                      f"step {step_ms:.3f} ms, {tok_s:.0f} tokens/s", flush=True)
    finally:
        stop.set()
        server.close()
    med = {w: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for w, v in results.items()}
    print(f"{args.model}, engine on cores {args.engine_cores}, {args.concurrency} clients, medians of {args.rounds} phases of "
          f"{args.seconds:.0f} s:")
    for watched, (step_ms, tok_s) in med.items():
        print(f"  {'watched  ' if watched else 'unwatched'} step {step_ms:.3f} ms, "
              f"{tok_s:.0f} tokens/s")
    print(f"  watched/unwatched: step time {med[True][0] / med[False][0] - 1:+.1%}, "
          f"throughput {med[True][1] / med[False][1] - 1:+.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--engine-cores", default="1",
                   help="VLLM_CPU_OMP_THREADS_BIND for the server's engine (default: core 1)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=8.0, help="length of one phase")
    p.add_argument("--rounds", type=int, default=4, help="phases of each kind")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}")
    for name, ns in per_record_costs().items():
        print(f"  {name}: {ns:.0f} ns a record")
    serving_costs(args)


if __name__ == "__main__":
    main()
