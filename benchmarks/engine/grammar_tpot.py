"""What a JSON-schema constraint costs per output token: TPOT with it against the same requests
without it, in one process, at batch 1 and 32 (issue 31's measure).

The default model (SmolLM2-135M), greedy, engine defaults, one engine for every run. Each
row of a batch asks for one of the `json-schema` bench dataset's schemas
(benchlib/json_schemas.py: a person, a book, an order) with that dataset's prompt; the
unconstrained run sends the same prompts without the schema. Both runs ignore EOS and stop at the same --max-tokens, small enough
that no JSON completes first, so both generate the same tokens per request and run steps of the
same shape. Prefix caching is on (the default): after the first run every prompt is cached, so
a batch is admitted in one step and its rows decode together from their first token. Reported
per run:
  - decode step: the median duration of the steps that decode the whole batch and prefill
    nothing (num_decode_reqs == B, num_prefill_tokens == 0 in the step trace; constrained, also
    num_grammar_rows == B). At batch B each request gets one token per step, so this is the
    per-token decode time with no prefill chunk mixed in;
  - TPOT: the median over requests of (last token - first token) / (tokens - 1), as the engine's
    RequestMetrics define it (prefill chunks of other rows included);
  - mask: the median grammar_mask_time of those decode steps (llguidance filling the rows'
    bitmasks plus the sampler applying them: docs/trace.md), and the apply's share (the
    executor's RunnerOutput.grammar_time).
Unconstrained and constrained runs alternate (their order swaps every round); the table holds
the medians over --rounds rounds, and the median of each round's constrained / unconstrained
ratio (paired: on a shared host a neighbour's burst spoils a round, not the column).

    .venv/bin/python benchmarks/engine/grammar_tpot.py [--rounds 5] [--max-tokens 32] [--threads N]
                                                       [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info, cpu_model  # noqa: E402

from chunkserve import LLM, SamplingParams  # noqa: E402
from chunkserve.benchlib.json_schemas import SCHEMAS, schema_prompt  # noqa: E402
from chunkserve.core.sched_output import SchedulerOutput  # noqa: E402
from chunkserve.engine.executor import RunnerOutput  # noqa: E402
from chunkserve.engine.trace import StepRecord  # noqa: E402
from chunkserve.outputs import RequestOutput  # noqa: E402
from chunkserve.sampling_params import StructuredOutputsParams  # noqa: E402

BATCHES = (1, 32)
MODES = ("free", "json")


@dataclass
class Run:
    round: int
    batch: int
    mode: str  # "free" (unconstrained) or "json" (each row under its JSON schema)
    step_ms: float  # median decode-only, whole-batch step
    tpot_ms: float  # median over requests
    mask_ms: float  # median grammar_mask_time of those steps
    apply_ms: float  # of which the sampler's apply (the rest: llguidance filling the rows)
    decode_steps: int  # steps that qualified
    tokens: float  # mean output tokens per request


def step_to_end(llm: LLM) -> tuple[list[StepRecord], list[RequestOutput], list[float]]:
    """Steps the engine until its requests are done: each step's record, the finished
    outputs, and each step's sampler share of grammar_mask_time (RunnerOutput.grammar_time,
    read by wrapping the executor for the run)."""
    engine = llm.engine
    executor = engine.executor
    execute = executor.execute
    apply_times: list[float] = []

    def timed(out: SchedulerOutput) -> RunnerOutput:
        result = execute(out)
        apply_times.append(result.grammar_time)
        return result

    executor.execute = timed  # type: ignore[method-assign]
    records, outputs = [], []
    try:
        while engine.has_unfinished_requests():
            step = engine.step()
            records.append(step.record)
            outputs += [o for o in step.outputs if o.finished]
    finally:
        del executor.execute  # the class's method again
    return records, outputs, apply_times


def run_batch(llm: LLM, rnd: int, batch: int, mode: str, max_tokens: int) -> Run:
    """Round `rnd`'s batch of `batch` requests, all added at once, stepped to the end."""
    for i in range(batch):
        schema = SCHEMAS[i % len(SCHEMAS)]
        structured = StructuredOutputsParams(json=schema) if mode == "json" else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                structured_outputs=structured)
        llm.engine.add_request(None, schema_prompt(schema), params)
    records, outputs, apply_times = step_to_end(llm)
    masked = batch if mode == "json" else 0
    decode = [i for i, r in enumerate(records) if r.num_prefill_tokens == 0
              and r.num_decode_reqs == batch and r.num_grammar_rows == masked]
    if not decode:
        raise RuntimeError(f"B={batch} {mode}: no step decoded the whole batch")
    return Run(rnd, batch, mode,
               step_ms=statistics.median(records[i].duration for i in decode) * 1e3,
               tpot_ms=statistics.median(o.metrics.tpot or 0.0 for o in outputs) * 1e3,
               mask_ms=statistics.median(records[i].grammar_mask_time for i in decode) * 1e3,
               apply_ms=statistics.median(apply_times[i] for i in decode) * 1e3,
               decode_steps=len(decode),
               tokens=statistics.mean(len(o.outputs[0].token_ids) for o in outputs))


def paired_ratio(runs: list[Run], batch: int, key: str) -> float:
    """The median over rounds of json / free within each round: a neighbour's burst that hits
    one round (this host is shared) moves one ratio, not the whole column."""
    ratios = []
    for rnd in sorted({r.round for r in runs}):
        pair = {r.mode: getattr(r, key) for r in runs if r.batch == batch and r.round == rnd}
        ratios.append(pair["json"] / pair["free"])
    return statistics.median(ratios)


def summarize(runs: list[Run]) -> list[dict[str, float]]:
    """Per batch size: the medians over rounds of each mode, and the paired json / free."""
    rows = []
    for batch in BATCHES:
        med = {mode: {key: statistics.median(getattr(r, key) for r in runs
                                             if r.batch == batch and r.mode == mode)
                      for key in ("step_ms", "tpot_ms", "mask_ms", "apply_ms", "tokens")}
               for mode in MODES}
        free, constrained = med["free"], med["json"]
        rows.append({"batch": batch,
                     **{f"{k}_free": v for k, v in free.items()},
                     **{f"{k}_json": v for k, v in constrained.items()},
                     "step_ratio": paired_ratio(runs, batch, "step_ms"),
                     "tpot_ratio": paired_ratio(runs, batch, "tpot_ms"),
                     "mask_us_per_row": constrained["mask_ms"] * 1e3 / batch})
    return rows


def table(rows: list[dict[str, float]]) -> str:
    lines = ["| B | decode step ms free / json | x paired | TPOT ms free / json | x paired | "
             "grammar_mask_time ms/step (apply) | µs/row | tokens/request free / json |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['step_ms_free']:.1f} / {r['step_ms_json']:.1f} | "
            f"{r['step_ratio']:.2f} | {r['tpot_ms_free']:.1f} / {r['tpot_ms_json']:.1f} | "
            f"{r['tpot_ratio']:.2f} | {r['mask_ms_json']:.2f} ({r['apply_ms_json']:.2f}) | "
            f"{r['mask_us_per_row']:.0f} | "
            f"{r['tokens_free']:.0f} / {r['tokens_json']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32,
                   help="per request, both modes (below any schema's JSON length)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one per core); 1 keeps a busy "
                        "neighbour's core out of every op's barrier")
    p.add_argument("--json", help="also write every run, the medians and the host here")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(f"CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    llm = LLM(model="smollm2-135m", max_model_len=512)
    for mode in MODES:  # warm-up: the grammar tokenizer, and every prompt into the cache
        run_batch(llm, -1, len(SCHEMAS), mode, 4)
    runs = []
    for rnd in range(args.rounds):
        for batch in BATCHES:
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                run = run_batch(llm, rnd, batch, mode, args.max_tokens)
                print(f"round {rnd} B={batch} {mode}: step {run.step_ms:.1f} ms, TPOT "
                      f"{run.tpot_ms:.1f} ms, mask {run.mask_ms:.2f} ms (apply "
                      f"{run.apply_ms:.2f}) "
                      f"({run.decode_steps} steps, {run.tokens:.0f} tokens)", flush=True)
                runs.append(run)
    llm.engine.close()
    rows = summarize(runs)
    print(f"\nmedians over {args.rounds} rounds, --max-tokens {args.max_tokens} "
          f"({time.perf_counter() - start:.0f} s; load average after: "
          f"{os.getloadavg()[0]:.2f})\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": cpu_info(), "args": vars(args), "summary": rows,
                       "runs": [asdict(r) for r in runs]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
