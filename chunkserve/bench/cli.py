"""`chunkserve bench <command>`: each command registers itself with one function below.

To add a command, write `_add_<name>(bench_sub)` (one `add_parser` call, its arguments, and
`set_defaults(func=...)` returning an exit code) and list it in `_COMMANDS`.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable


def _add_serve(bench_sub: argparse._SubParsersAction) -> None:
    from chunkserve.bench.serve_bench import add_serve_args, run_bench_serve

    p = bench_sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (vllm bench serve's flags)")
    add_serve_args(p)
    p.set_defaults(func=run_bench_serve)


def _add_sweep(bench_sub: argparse._SubParsersAction) -> None:
    from chunkserve.bench.sweep_cli import add_bench_sweep_args, run_sweep

    p = bench_sub.add_parser(
        "sweep", help="replay one workload over many chunk sizes on the in-process engine")
    add_bench_sweep_args(p)
    p.set_defaults(func=run_sweep)


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_serve, _add_sweep]


def add_bench_parsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add `bench` to the top-level subparsers; returns bench's own subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: a running server (serve), chunk sizes (sweep)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for add in _COMMANDS:
        add(bench_sub)
    return bench_sub
