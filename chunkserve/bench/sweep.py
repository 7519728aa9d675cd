"""`chunkserve bench sweep`: one workload, many chunk sizes, the real engine, wall-clock time.

Every configuration replays the *same* requests at the *same* arrival offsets, in process (no
HTTP, so only scheduling differs). A request's arrival time is its scheduled arrival, not the
moment the loop noticed it: a request that arrives during a long step waits for it, and that
wait is part of its TTFT — exactly the head-of-line blocking being measured.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkserve.bench.metrics import RequestResult, compute_metrics
from chunkserve.bench.step_stats import step_metrics
from chunkserve.bench.workloads import BenchRequest
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.trace import StepRecord
from chunkserve.model.factory import LoadedModel
from chunkserve.outputs import RequestOutput
from chunkserve.sampling_params import SamplingParams

ChunkSize = int | str  # an int budget, or "none" for the no-chunk baseline


@dataclass
class SweepPoint:
    chunk_size: ChunkSize
    scheduler: str

    def engine_kwargs(self, max_model_len: int) -> dict[str, Any]:
        if self.chunk_size == "none":
            # The no-chunk baseline has no chunk to size: static even in an adaptive sweep.
            return dict(scheduler=self.scheduler, max_num_batched_tokens=max_model_len,
                        chunk_policy="static", target_itl_ms=None)
        return dict(scheduler=self.scheduler, max_num_batched_tokens=int(self.chunk_size))


@dataclass
class RunResult:
    point: SweepPoint
    results: list[RequestResult]
    records: list[StepRecord]
    duration: float  # first arrival to last completion, seconds
    extra: dict[str, Any] = field(default_factory=dict)


def parse_chunk_sizes(text: str) -> list[ChunkSize]:
    sizes: list[ChunkSize] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "none":
            sizes.append("none")
        elif part.isdigit() and int(part) > 0:
            sizes.append(int(part))
        else:
            raise ValueError(f"--chunk-sizes: expected 'none' or a positive integer, got {part!r}")
    if not sizes:
        raise ValueError("--chunk-sizes is empty")
    return sizes


def sweep_points(sizes: Sequence[ChunkSize], scheduler: str, baseline: str) -> list[SweepPoint]:
    return [SweepPoint(s, baseline if s == "none" else scheduler) for s in sizes]


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
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    clock: Callable[[], float] = time.monotonic,
    on_step: Callable[[LLMEngine], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Feeds requests at their arrival offsets, steps the engine, returns results + duration.

    `on_step(engine)` runs after every step (calibration reads the step's shape there).
    """
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    results: dict[str, RequestResult] = {}
    start = clock()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = clock()
        while nxt < len(order) and start + arrivals[order[nxt]] <= now:
            i = order[nxt]
            req = requests[i]
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{i}", req.prompt_token_ids, params, start + arrivals[i])
            nxt += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = result_from_output(out, start)
            if on_step is not None:
                on_step(engine)
        elif nxt < len(order):
            time.sleep(max(0.0, start + arrivals[order[nxt]] - clock()))
    duration = clock() - start
    return [results[f"r{i}"] for i in range(len(requests))], duration


def run_point(
    loaded: LoadedModel,
    point: SweepPoint,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    engine_kwargs: dict[str, Any],
    on_step: Callable[[LLMEngine], None] | None = None,
) -> RunResult:
    engine = LLMEngine.from_kwargs(
        loaded=loaded, model=loaded.path,
        **{**engine_kwargs, **point.engine_kwargs(loaded.max_model_len)},
    )
    engine.trace.keep_all()
    results, duration = replay(engine, requests, arrivals, on_step=on_step)
    return RunResult(point, results, list(engine.trace.records), duration)


def summarize(
    run: RunResult, percentiles: list[float], goodput: dict[str, float] | None
) -> dict[str, Any]:
    """One results.json entry: the configuration, vLLM's metric keys, then ours."""
    metrics = compute_metrics(run.results, run.duration, percentiles, goodput)
    return {
        "chunk_size": run.point.chunk_size,
        "scheduler": run.point.scheduler,
        **metrics,
        **step_metrics(run.records),
        **run.extra,
    }


def measure_capacity(
    loaded: LoadedModel,
    requests: Sequence[BenchRequest],
    engine_kwargs: dict[str, Any],
    point: SweepPoint,
) -> float:
    """Requests/s the engine sustains on (a sample of) this workload, all arriving at once.

    `--load 0.7` then means 70% of that: busy enough for queues to form, not saturated.
    """
    sample = list(requests[: max(8, len(requests) // 4)])
    run = run_point(loaded, point, sample, [0.0] * len(sample), engine_kwargs)
    return len(sample) / run.duration
