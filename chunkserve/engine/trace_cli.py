"""`chunkserve trace convert IN OUT`: a step trace taken earlier (JSONL, or .jsonl.gz) as a
Perfetto timeline (engine/timeline.py): the same events the engine writes with
`--trace-format perfetto`."""
from __future__ import annotations

import argparse

from chunkserve.engine.trace import read_trace, trace_format_of


def add_trace_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True)
    convert = sub.add_parser("convert", help="a JSONL step trace as a Perfetto timeline")
    convert.add_argument("input", help="a step trace: --trace-file's JSONL (.jsonl or .jsonl.gz)")
    convert.add_argument("output", help="the timeline to write (.json; open it in "
                                        "ui.perfetto.dev or chrome://tracing)")
    convert.add_argument("--simulated", action="store_true",
                         help="label the timeline as simulated (a `chunkserve sim` trace)")
    convert.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from chunkserve.engine.timeline import write_timeline

    if trace_format_of(args.input) != "jsonl":
        raise ValueError(f"{args.input}: expected a JSONL step trace (.jsonl or .jsonl.gz); "
                         "a .json file is already a timeline")
    records = read_trace(args.input)
    if not records:
        raise ValueError(f"{args.input}: no step records in it")
    write_timeline(args.output, records, simulated=args.simulated)
    print(f"wrote {args.output}: {len(records)} steps; open it in https://ui.perfetto.dev")
    return 0
