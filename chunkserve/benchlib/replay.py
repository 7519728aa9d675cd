"""The one replay loop: a workload fed to an engine at its arrival times, on the engine's clock.

`bench sweep` runs it on the real engine and the wall clock, `chunkserve sim` on the cost-model
executor and a virtual clock; the loop is the same, so both measure the same thing. A request's
arrival time is its scheduled arrival, not the moment the loop noticed it: a request that
arrives during a long step waits for it, and that wait is part of its TTFT — exactly the
head-of-line blocking being measured.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from chunkserve.benchlib.metrics import RequestResult
from chunkserve.benchlib.sweep import RunResult, SweepPoint
from chunkserve.benchlib.workloads import BenchRequest
from chunkserve.engine.clock import Clock
from chunkserve.engine.llm_engine import LLMEngine, StepResult
from chunkserve.engine.trace import StepRecord
from chunkserve.outputs import RequestOutput
from chunkserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


def result_from_output(out: RequestOutput, start_offset: float) -> RequestResult:
    """A finished engine output as the benchmark's per-request record (seconds)."""
    m = out.metrics
    times = m.token_times
    return RequestResult(
        success=out.outputs[0].finish_reason in ("stop", "length"),
        prompt_len=len(out.prompt_token_ids),
        output_len=len(out.outputs[0].token_ids),
        ttft=(m.ttft or 0.0),
        itl=[b - a for a, b in zip(times, times[1:])],
        latency=(m.e2e_latency or 0.0),
        start_time=m.arrival_time - start_offset,
    )


def replay(
    engine: LLMEngine,
    point: SweepPoint,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    clock: Clock,
    on_step: Callable[[StepResult], None] | None = None,
) -> RunResult:
    """Feeds requests at their arrival offsets, steps the engine until all are done.

    `clock` must be the engine's own; `on_step` sees every step (calibration reads shapes).
    Requests ignore EOS and run to their output length, so every configuration does the same
    work; one with a JSON schema (greedy, so the same JSON in every configuration) stops
    where its JSON ends.
    """
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    results: dict[str, RequestResult] = {}
    records: list[StepRecord] = []
    start = clock.time()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = clock.time()
        while nxt < len(order) and start + arrivals[order[nxt]] <= now:
            i = order[nxt]
            req = requests[i]
            structured = (StructuredOutputsParams(json=req.json_schema)
                          if req.json_schema is not None else None)
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY,
                                    structured_outputs=structured)
            engine.add_request(f"r{i}", req.prompt_token_ids, params, start + arrivals[i])
            nxt += 1
        if engine.has_unfinished_requests():
            step = engine.step()
            records.append(step.record)
            for out in step.outputs:
                if out.finished:
                    results[out.request_id] = result_from_output(out, start)
            if on_step is not None:
                on_step(step)
        else:  # idle until the next arrival: the wall clock sleeps, a virtual one jumps
            clock.sleep_until(start + arrivals[order[nxt]])
    return RunResult(point, [results[f"r{i}"] for i in range(len(requests))], records,
                     clock.time() - start)
