"""`chunkserve diagnose STEPS.jsonl [--requests REQS.json] [--plot out.png] [--json]`."""
from __future__ import annotations

import argparse
import json
import sys

from chunkserve.diagnose.report import diagnose
from chunkserve.diagnose.text import format_text
from chunkserve.engine.trace import read_trace


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="STEPS.jsonl",
                   help="a step trace: --trace-file of the engine or server (.jsonl or .jsonl.gz)")
    p.add_argument("--requests", default=None, metavar="REQS.json",
                   help="prompt lengths by request id, to name the prompt behind a long step: "
                        '{"r0": 812, ...}, [{"request_id": ..., "prompt_len": ...}], or a '
                        "`bench serve --save-detailed` result (input_lens; ids r0, r1, ...)")
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="the token gap to suggest flags for (default: 2x the median gap)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write the step timeline")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.add_argument("--perfetto", default=None, metavar="OUT.json",
                   help="write the trace's Perfetto timeline with the worst token gaps drawn "
                        "on it, named by cause (open it in ui.perfetto.dev)")


def load_prompt_lens(path: str) -> dict[str, int]:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and "input_lens" in data:
        return {f"r{i}": int(n) for i, n in enumerate(data["input_lens"])}
    if isinstance(data, dict):
        return {str(k): int(v) for k, v in data.items()}
    if isinstance(data, list):
        return {str(e["request_id"]): int(e["prompt_len"]) for e in data}
    raise ValueError(f"{path}: expected prompt lengths by request id")


def run_diagnose(args: argparse.Namespace) -> int:
    records = read_trace(args.trace)
    if not records:
        raise ValueError(f"{args.trace}: empty trace (no step records)")
    prompt_lens = load_prompt_lens(args.requests) if args.requests else None
    d = diagnose(records, prompt_lens, args.target_itl_ms)
    if args.plot:
        from chunkserve.diagnose.plot import plot_timeline

        plot_timeline(records, d, args.plot)
    if args.perfetto:
        from chunkserve.diagnose.perfetto import write_diagnosed_timeline

        num_gaps = write_diagnosed_timeline(args.perfetto, records)
    print(json.dumps(d, indent=2) if args.json else format_text(d, args.trace))
    if args.plot and not args.json:
        print(f"\ntimeline: {args.plot}", file=sys.stderr)
    if args.perfetto and not args.json:
        print(f"Perfetto timeline with the {num_gaps} worst gaps: {args.perfetto}",
              file=sys.stderr)
    return 0
