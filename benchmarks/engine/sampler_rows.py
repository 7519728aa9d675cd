"""What one request's top_p costs the other rows of its step: the sampler on B random rows of the
default model's vocabulary (49,152), with none, one or all of them setting top_p (issue 51).

The sampler sorts only the rows that set top-k or top-p. `sort-all` is the rule it replaced,
timed in the same run: every random row of the step sorted as soon as one row set top_p (the
others with top_p=1.0, which keeps their distribution as it is but pays the sort). Cases
alternate every repetition, so a neighbour's burst spoils a round, not a column; the table
holds each case's median and the slowest draw.

    .venv/bin/python benchmarks/engine/sampler_rows.py [--rows 8] [--vocab 49152] [--repeats 600]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402

from chunkserve.engine import sampler  # noqa: E402
from chunkserve.engine.sampler import Sampler, SamplingRow  # noqa: E402
from chunkserve.sampling_params import SamplingParams  # noqa: E402


def rows_with(n: int, n_top_p: int) -> list[SamplingRow]:
    """n random rows (temperature 0.8), the first n_top_p of which set top_p=0.9."""
    return [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9 if i < n_top_p else 1.0),
                        None, 0, [0]) for i in range(n)]


def sort_all(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The replaced rule: once any row cuts, every row is sorted (a top_p of 1.0 keeps all)."""
    temp = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    return sampler._top_k_top_p(logits.float() / temp, params).softmax(dim=-1)


def cases(logits: torch.Tensor, n: int) -> dict[str, Callable[[], object]]:
    sample = Sampler()
    one, none, every = rows_with(n, 1), rows_with(n, 0), rows_with(n, n)
    uniforms = torch.rand(n)
    return {
        "no top_p": lambda: sample(logits, none),
        "one top_p": lambda: sample(logits, one),
        "all top_p": lambda: sample(logits, every),
        "one top_p, sort-all": lambda: sampler.inverse_cdf(
            sort_all(logits, [r.params for r in one]), uniforms),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=600)
    args = p.parse_args()
    print(f"CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}; "
          f"{args.rows} rows x {args.vocab} vocab, {args.repeats} repeats")
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    fns = cases(logits, args.rows)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for r in range(args.repeats):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["no top_p"])
    print(f"{'case':<22}{'median ms':>10}{'max ms':>9}{'x no top_p':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<22}{med * 1e3:>10.2f}{max(ts) * 1e3:>9.2f}{med / base:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
