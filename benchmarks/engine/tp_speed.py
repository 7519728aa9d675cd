"""Tensor parallelism on this CPU: TP=2 (one thread a rank) against TP=1 (all threads), issue 30.

Same model, same engine loop, one run each, alternating; medians of the steps of each kind:
- prefill: one prompt of --prompt-len tokens in chunks of --budget (no decodes beside it);
- decode: --batch requests decoding together, step time once every prompt is in.
For TP=2 it also times rank 0's collectives (the all-reduces and the logits' all-gather, as
rank 0 sees them: waiting for the other rank included) per step, so the simulator's TP
communication term can be checked against it.

    .venv/bin/python benchmarks/engine/tp_speed.py --model gemma3-270m
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_model  # noqa: E402


class CollectiveTimer:
    """Wraps rank 0's group methods; `take()` returns and resets the seconds spent in them."""

    def __init__(self, group: Any) -> None:
        self.spent = 0.0
        for name in ("all_reduce", "all_gather"):
            setattr(group, name, self._timed(getattr(group, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            self.spent += time.perf_counter() - t0
            return out
        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def timed_steps(engine: LLMEngine, timer: CollectiveTimer | None) -> list[tuple[float, float]]:
    """(step seconds, collective seconds) of every step until the engine is idle."""
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, timer.take() if timer else 0.0))
    return steps


def run(tp: int, args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine.from_kwargs(model=args.model, tensor_parallel_size=tp,
                                   max_num_batched_tokens=args.budget, max_model_len=4096,
                                   enable_prefix_caching=False)
    timer = CollectiveTimer(engine.executor.group) if tp > 1 else None  # type: ignore[attr-defined]
    try:
        prompt = [1000 + (7 * i) % 5000 for i in range(args.prompt_len)]
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        prefill = timed_steps(engine, timer)
        for i in range(args.batch):
            engine.add_request(f"d{i}", [2000 + i] * 16,
                               SamplingParams(max_tokens=args.decode_steps, ignore_eos=True))
        decode = timed_steps(engine, timer)[2:]  # past the prompts' step(s)
    finally:
        engine.close()
    return {"tp": tp, "prefill_step_s": statistics.median(s for s, _ in prefill),
            "prefill_tok_s": args.budget / statistics.median(s for s, _ in prefill),
            "prefill_collectives_s": statistics.median(c for _, c in prefill),
            "decode_step_s": statistics.median(s for s, _ in decode),
            "decode_collectives_s": statistics.median(c for _, c in decode)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(cpu_model(), flush=True)
    results = []
    for r in range(args.repeats):
        for tp in ((1, 2) if r % 2 == 0 else (2, 1)):
            results.append(run(tp, args))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host": cpu_model(), "args": vars(args), "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
