"""Discrete-event simulation: the real scheduler, a virtual clock, a cost model for the model.

`SimEngine.step()` is `LLMEngine.step()` with the model runner replaced by "advance the clock by
the cost model's step time and sample a dummy token": the same `Scheduler` and `KVCacheManager`
classes, the same config, the same per-request metrics and step records. Simulated requests
ignore EOS and run to their output length, as the benchmark's do.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chunkserve.bench.sweep import RunResult, SweepPoint, result_from_output
from chunkserve.bench.workloads import BenchRequest
from chunkserve.config import DEFAULT_MIN_CHUNK_TOKENS, CacheConfig, SchedulerConfig
from chunkserve.core.request import Request
from chunkserve.core.sched_output import SchedulerOutput
from chunkserve.core.scheduler import Scheduler
from chunkserve.engine.trace import StepTrace, step_record
from chunkserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.sampling_params import SamplingParams
from chunkserve.sim.cost_model import CostModel, StepShape, planned_step_time, step_time

DUMMY_TOKEN = 0  # simulated requests ignore EOS, so the sampled id never matters


@dataclass
class SimConfig:
    max_model_len: int
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0
    chunk_policy: str = "static"  # adaptive: chunk sized from the cost model (chunk size = cap)
    target_itl_ms: float | None = None
    min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS


class SimEngine:
    def __init__(self, point: SweepPoint, config: SimConfig, cost_model: CostModel) -> None:
        budget = config.max_model_len if point.chunk_size == "none" else int(point.chunk_size)
        # The no-chunk baseline has no chunk to size: it stays static in an adaptive sweep.
        adaptive = config.chunk_policy == "adaptive" and point.chunk_size != "none"
        sched = SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len, scheduler=point.scheduler,
            chunk_policy="adaptive" if adaptive else "static",
            target_itl_ms=config.target_itl_ms if adaptive else None,
            min_chunk_tokens=config.min_chunk_tokens,
        )
        cache = CacheConfig(block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
                            preemption_mode=config.preemption_mode)
        self.scheduler = Scheduler(sched, cache, config.num_kv_blocks, config.num_swap_blocks,
                                   step_time=planned_step_time(cost_model) if adaptive else None)
        self.cost_model = cost_model
        self.clock = 0.0
        self.trace = StepTrace(None, max_records=None)
        self._metrics: dict[str, RequestMetrics] = {}
        self.scheduled_log: list[list[tuple[str, int]]] = []  # (request, tokens) of every step

    def add_request(self, request_id: str, prompt_len: int, output_len: int, arrival: float) -> None:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        req = Request(request_id, [DUMMY_TOKEN] * prompt_len, params, arrival)
        self.scheduler.add_request(req)
        self._metrics[request_id] = RequestMetrics(arrival)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        start = self.clock
        out: SchedulerOutput = self.scheduler.schedule()
        self.scheduled_log.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
        for sr in out.scheduled:
            self._metrics[sr.request.request_id].on_scheduled(start)
        duration = step_time(self.cost_model, StepShape.from_output(out))
        self.clock = now = start + duration
        sampled = {s.request.request_id: DUMMY_TOKEN for s in out.scheduled if s.samples}
        finished = []
        for req in self.scheduler.update_from_output(out, sampled):
            m = self._metrics[req.request_id]
            m.on_token(now)
            if req.status.finished:
                m.finished_time = now
                m.num_preemptions = req.num_preemptions
                finished.append(self._output(req, self._metrics.pop(req.request_id)))
        self.trace.add(step_record(len(self.trace.records), start, duration, out))
        return finished

    @staticmethod
    def _output(req: Request, m: RequestMetrics) -> RequestOutput:
        completion = CompletionOutput(0, "", list(req.output_token_ids), req.status.finish_reason)
        return RequestOutput(req.request_id, None, req.prompt_token_ids, [completion], True, m)


def simulate(
    point: SweepPoint,
    config: SimConfig,
    cost_model: CostModel,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
) -> RunResult:
    """Replays the workload on the virtual clock; the same shape of result as a real sweep."""
    engine = SimEngine(point, config, cost_model)
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    results = {}
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        while nxt < len(order) and arrivals[order[nxt]] <= engine.clock:
            i = order[nxt]
            engine.add_request(f"r{i}", requests[i].prompt_len, requests[i].output_len, arrivals[i])
            nxt += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = result_from_output(out, 0.0)
        else:  # idle: jump to the next arrival
            engine.clock = max(engine.clock, arrivals[order[nxt]])
    return RunResult(point, [results[f"r{i}"] for i in range(len(requests))],
                     list(engine.trace.records), engine.clock)


def length_requests(input_lens: Sequence[int], output_lens: Sequence[int]) -> list[BenchRequest]:
    """Workload requests that carry lengths only: all a simulation needs."""
    return [BenchRequest("", [], int(i), int(o)) for i, o in zip(input_lens, output_lens)]
