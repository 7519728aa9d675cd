"""The example timelines of docs/trace.md (issue 32): the article's head-of-line stall, seen.

Four short requests decode; half a second in, a long prompt arrives. Without chunking
(`prefill-first`) its whole prefill is one step, and every decode waits for it; with a budget
of 256 tokens (`decode-first`) the prompt goes through in chunks beside the decodes. Both runs
use the same requests and arrivals on SmolLM2, and each writes a Perfetto timeline to
docs/results/timeline/. Prints the CPU, each run's longest decode gap (the stall) and TTFT of
the long prompt.

    .venv/bin/python benchmarks/engine/timeline_example.py
"""
from __future__ import annotations

import os
import sys

import numpy as np

from chunkserve.bench.sweep import SweepPoint, run_point
from chunkserve.benchlib.workloads import BenchRequest
from chunkserve.engine.timeline import write_timeline
from chunkserve.model.factory import load_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results", "timeline")
LONG_PROMPT = 1536


def workload(vocab: int) -> tuple[list[BenchRequest], list[float]]:
    rng = np.random.default_rng(0)

    def request(prompt_len: int, output_len: int) -> BenchRequest:
        ids = [int(t) for t in rng.integers(100, vocab - 100, prompt_len)]
        return BenchRequest("", ids, prompt_len, output_len)

    short = [request(32, 48) for _ in range(4)]
    return [*short, request(LONG_PROMPT, 8)], [0.0, 0.0, 0.0, 0.0, 0.5]


def main() -> None:
    print(f"CPU: {cpu_model()}")
    loaded = load_model("smollm2-135m")
    requests, arrivals = workload(loaded.config.vocab_size)
    engine = dict(max_model_len=2048, enable_prefix_caching=False)
    os.makedirs(OUT, exist_ok=True)
    for name, point in (("nochunk", SweepPoint(None, "prefill-first")),
                        ("chunk256", SweepPoint(256, "decode-first"))):
        run = run_point(loaded, point, requests, arrivals, engine)
        path = os.path.join(OUT, f"{name}.json")
        write_timeline(path, run.records)
        stall = max(max(r.itl) for r in run.results[:4])
        print(f"{name:9s} longest decode gap {stall * 1e3:7.1f} ms, long prompt TTFT "
              f"{run.results[4].ttft * 1e3:7.1f} ms, {len(run.records)} steps, "
              f"{os.path.getsize(path) / 1024:.0f} KiB -> {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
