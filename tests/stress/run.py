"""`make stress`: start a real server on loopback, run every phase, print one table, and exit
non-zero on any violation.

    .venv/bin/python tests/stress/run.py [--minutes 10] [--model tiny-llama] [--skip soak]

Phases: (a) fuzz (>= 1,000 malformed requests, twice, RSS read around each pass) and schemathesis against /openapi.json; (b) a
disconnect storm; (c) an overload burst at 5x the waiting cap; (c') slow clients (stalled headers and bodies
closed within the deadlines) and the connection cap; (d) a soak at a steady mixed load
(--minutes, default 10) with RSS sampled; (e) SIGTERM with streams in flight, on a fresh server.
After (a)-(d) /metrics must show running = waiting = KV usage = 0 within 5 s.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from stress.fuzz import run_schemathesis  # noqa: E402
from stress.fuzz_cases import all_cases  # noqa: E402
from stress.memory import run_fuzz_memory  # noqa: E402
from stress.overload import run_overload  # noqa: E402
from stress.report import PhaseResult, render_table, violations  # noqa: E402
from stress.shutdown import run_shutdown  # noqa: E402
from stress.soak import run_soak  # noqa: E402
from stress.storm import run_storm  # noqa: E402
from stress.slow_clients import run_slow_clients  # noqa: E402
from stress.target import CONNECTION_CAP, HEADER_TIMEOUT_S, Target, server_args  # noqa: E402

PHASES = ("fuzz", "schemathesis", "storm", "overload", "slow-clients", "soak", "sigterm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama", help="any `chunkserve serve` model")
    p.add_argument("--minutes", type=float, default=10.0, help="soak length (default 10)")
    p.add_argument("--load", type=float, default=0.7, help="soak load, fraction of capacity")
    p.add_argument("--calibrate-seconds", type=float, default=60.0)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-waiting", type=int, default=8, help="--max-waiting-requests")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--shutdown-timeout", type=float, default=3.0, help="the SIGTERM grace period")
    p.add_argument("--fuzz-cases", type=int, default=0, help="0: all of them")
    p.add_argument("--schemathesis-examples", type=int, default=50)
    p.add_argument("--storm-clients", type=int, default=64)
    p.add_argument("--slow-clients", type=int, default=150,
                   help="connections that stall in headers or body (phase slow-clients)")
    p.add_argument("--sigterm-streams", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", nargs="*", default=[], choices=PHASES)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> tuple[list[PhaseResult], list[str]]:
    def start(max_model_len: int) -> Target:
        return Target(args.model, server_args(args.model, max_model_len, args.max_waiting,
                                              args.max_num_seqs, args.shutdown_timeout),
                      args.max_waiting)

    results: list[PhaseResult] = []
    footer: list[str] = []
    target = start(args.max_model_len)
    cases = all_cases(args.seed)
    phases: list[tuple[str, Callable[[], PhaseResult]]] = [
        ("fuzz", lambda: run_fuzz_memory(target, cases[: args.fuzz_cases or None])),
        ("schemathesis", lambda: run_schemathesis(target, args.schemathesis_examples, args.seed)),
        ("storm", lambda: run_storm(target, args.storm_clients, args.max_waiting,
                                    args.max_model_len - 16, args.seed)),
        ("overload", lambda: run_overload(target, 5, 16, args.max_num_seqs,
                                          args.max_model_len - 16)),
        ("slow-clients", lambda: run_slow_clients(target, args.slow_clients, HEADER_TIMEOUT_S,
                                                  CONNECTION_CAP)),
        ("soak", lambda: run_soak(target, args.minutes, args.load, args.calibrate_seconds,
                                  args.max_num_seqs, args.seed)),
    ]
    try:
        footer.append(f"server: {args.model}, RSS {target.rss_mb():.0f} MB after start")
        for name, phase in phases:
            if name in args.skip:
                continue
            print(f"[stress] {name} ...", flush=True)
            result = phase()
            result.idle = target.wait_idle()
            results.append(result)
            print(f"[stress] {name}: {result.requests} requests, {result.seconds:.0f} s, "
                  f"{len(result.all_violations())} violations", flush=True)
        footer.append(f"RSS {target.rss_mb():.0f} MB after the phases")
        footer += [f"VIOLATION {p}" for p in target.log_problems()]
    finally:
        target.close()
    if "sigterm" not in args.skip:
        print("[stress] sigterm ...", flush=True)
        # A fresh server with room for streams that outlive the grace period.
        length = max(args.max_model_len, 2048 if args.model == "tiny-llama" else 512)
        fresh = start(length)
        try:
            results.append(run_shutdown(fresh, args.shutdown_timeout, args.sigterm_streams, length))
            footer += [f"VIOLATION SIGTERM server {p}" for p in fresh.log_problems()]
        finally:
            fresh.close()
    return results, footer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    results, footer = run(args)
    found = violations(results) + [f[len("VIOLATION "):] for f in footer if f.startswith("VIOLATION")]
    footer = [f for f in footer if not f.startswith("VIOLATION")]
    footer.append(f"total {time.monotonic() - began:.0f} s; "
                  + ("PASS: no violations" if not found else f"FAIL: {len(found)} violations"))
    print(render_table(results, footer))
    for v in found:
        print(f"VIOLATION {v}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
