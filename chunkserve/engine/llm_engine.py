"""The engine loop: schedule → run → sample → bookkeeping, one `step()` at a time."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from chunkserve.config import DEFAULT_KV_CACHE_GIB, EngineConfig, SchedulerConfig
from chunkserve.core.chunk_budget import StepTimeFn
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched_output import ScheduledRequest
from chunkserve.core.scheduler import Scheduler
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.model_runner import ModelRunner, kv_bytes_per_block
from chunkserve.engine.trace import StepTrace, step_record
from chunkserve.model.factory import LoadedModel, load_model
from chunkserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.sampling_params import SamplingParams

GiB = 1 << 30


def _step_time(sc: SchedulerConfig, model: str) -> StepTimeFn | None:
    """The adaptive chunk policy's step-time model; the static policy needs none."""
    if sc.chunk_policy != "adaptive":
        return None
    from chunkserve.engine.step_cost import engine_step_time  # the simulator's cost models

    return engine_step_time(sc.cost_model, model)


@dataclass
class _RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        loaded: LoadedModel | None = None,
    ) -> None:
        """`loaded` lets several engines share one set of weights (tests, sweeps): the model
        is stateless, each engine owns its KV cache."""
        self.config = config
        self.clock = clock
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        if loaded is None:
            loaded = load_model(
                mc.model, mc.dtype, mc.max_model_len, mc.device, load_format=mc.load_format,
                attention_backend=mc.attention_backend, seed=mc.seed,
                quantization=mc.quantization,
            )
        elif mc.max_model_len is not None and mc.max_model_len > loaded.max_model_len:
            raise ValueError(
                f"max_model_len ({mc.max_model_len}) exceeds the shared model's "
                f"({loaded.max_model_len})"
            )
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = mc.max_model_len or loaded.max_model_len
        self.dtype = loaded.model.dtype
        sc.max_model_len = self.max_model_len
        sc.finalize()

        block_bytes = kv_bytes_per_block(loaded.model, cc.block_size)
        kv_gib = cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_KV_CACHE_GIB
        num_blocks = cc.num_kv_blocks or int(kv_gib * GiB // block_bytes)
        if num_blocks * cc.block_size < self.max_model_len:
            raise ValueError(
                f"The KV cache holds {num_blocks * cc.block_size} tokens ({num_blocks} blocks of "
                f"{cc.block_size}), fewer than max_model_len ({self.max_model_len}): one long "
                "request could never run. Increase --kv-cache-memory / --num-kv-blocks or "
                "decrease --max-model-len."
            )
        num_swap = int(cc.swap_space * GiB // block_bytes) if cc.preemption_mode == "swap" else 0
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(sc, cc, num_blocks, num_swap, step_time=_step_time(sc, mc.model))
        self.eos_token_ids = loaded.config.eos_token_ids or (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        )
        self.runner = ModelRunner(
            loaded.model, num_blocks, cc.block_size, num_swap, enforce_eager=mc.enforce_eager,
            max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len,
        )
        self.trace = StepTrace(config.trace_file)
        self._states: dict[str, _RequestState] = {}
        self._step_count = 0
        self._next_id = 0
        self.last_scheduled: list[ScheduledRequest] = []

    @classmethod
    def from_kwargs(cls, loaded: LoadedModel | None = None, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs), loaded=loaded)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = self.prepare_params(token_ids, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        req = Request(request_id, token_ids, params, arrival, self.eos_token_ids, priority)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        self._states[request_id] = _RequestState(req, text, detok, RequestMetrics(arrival))
        self.scheduler.add_request(req)
        return request_id

    def prepare_params(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Checks a request against the model; returns params with max_tokens filled in.

        Reads only immutable engine attributes, so the server calls it from its own thread
        to answer 400 before the request ever reaches the engine loop.
        """
        max_tokens = self._max_tokens(token_ids, params)
        return params if max_tokens == params.max_tokens else replace(params, max_tokens=max_tokens)

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise ValueError("The prompt cannot be empty.")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"Token ids must be integers in [0, {vocab}).")
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages."
            )
        if params.max_tokens is None:
            return limit - n
        if params.max_tokens > limit - n:
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {limit} tokens and your request has "
                f"{n} input tokens ({params.max_tokens} > {limit} - {n})."
            )
        return params.max_tokens

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.clock()
        out = self.scheduler.schedule()
        self.last_scheduled = out.scheduled  # lets a caller contain a failed step
        for sr in out.scheduled:
            self._states[sr.request.request_id].metrics.on_scheduled(start)
        result = self.runner.execute(out)
        now = self.clock()
        updated = self.scheduler.update_from_output(out, result.sampled)
        outputs = [self._process(req, now, result.logprobs.get(req.request_id)) for req in updated]

        self.trace.add(step_record(self._step_count, start, self.clock() - start, out))
        self._step_count += 1
        return outputs

    def _process(
        self, req: Request, now: float, logprobs: list[tuple[int, float]] | None
    ) -> RequestOutput:
        state = self._states[req.request_id]
        if logprobs is not None:
            state.logprobs.append(logprobs)
        m = state.metrics
        m.on_token(now)
        stop = state.detokenizer.update(req.output_token_ids[-1:])
        if stop is not None:
            req.stop_reason = stop
            if req.status.finished:  # also hit a length/EOS limit: the stop string wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        finished = req.status.finished
        m.num_preemptions = req.num_preemptions
        if finished:
            m.finished_time = now
            del self._states[req.request_id]
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(state.logprobs) if req.sampling_params.logprobs is not None else None,
            delta_text=state.detokenizer.get_next_delta(finished),
        )
        return RequestOutput(
            req.request_id, state.prompt, req.prompt_token_ids, [completion], finished, m
        )

    def commit_kv_memory(self) -> None:
        """Writes the KV pools once, so all their memory is resident from now on.

        The runner allocates them untouched (free until used, right for a short benchmark), and
        block placement walks the whole pool over time, so a long-running server's RSS climbed
        by up to the pool's size (2 GiB by default) for as long as it served: indistinguishable
        from a leak, and an out-of-memory that hits hours in rather than at startup.
        """
        for pool in (self.runner.kv_cache, self.runner.swap_cache):
            if pool is not None:
                pool.zero_()

    def close(self) -> None:
        self.trace.close()

