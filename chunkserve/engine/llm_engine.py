"""The engine loop: schedule → execute → update → record, one `step()` at a time.

The loop is the same whatever executes the step: `ModelRunner` (the model, wall clock) or the
simulator's cost-model executor (virtual clock). Both get the same scheduler, the same
per-request metrics and the same step records, so a simulation is this loop, not a copy of it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from chunkserve.config import EngineConfig
from chunkserve.core.chunk_budget import LearnedStepTime, PlannedStep, StepObservation
from chunkserve.core.kv_groups import group_layers
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput
from chunkserve.core.scheduler import Scheduler
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.executor import Executor, FatalExecutorError
from chunkserve.engine.processor import EngineRequest, Processor
from chunkserve.engine.trace import StepRecord, step_record
from chunkserve.engine.trace_writer import StepTrace
from chunkserve.outputs import CompletionOutput, RequestError, RequestMetrics, RequestOutput
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from chunkserve.model.factory import LoadedModel

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    outputs: list[RequestOutput]  # one per request that got a token or finished this step
    record: StepRecord  # the step's trace record
    scheduled: list[ScheduledRequest]  # what the step ran (calibration reads its shape)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    kv_internal_fragmentation: int  # allocated slots minus stored tokens


class StepError(RuntimeError):
    """A step failed after scheduling: `request_ids` are the requests it was running (their
    tokens were already counted as computed, so the caller should abort them)."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s)")
        self.request_ids = request_ids


@dataclass
class _RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer (simulation)
    metrics: RequestMetrics
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # One slot per prompt token when the request asked for prompt logprobs (else None), filled
    # by position as its prefill chunks run: a chunk recomputed after preemption overwrites.
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Structured outputs: the request's llguidance matcher (engine/grammar.py), else None.
    matcher: Any = None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        processor: Processor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`config` is resolved (EngineConfig.resolve); `executor` owns the KV pool the
        scheduler allocates in; `processor` is what add_request validates with."""
        assert config.scheduler_config.is_resolved, "LLMEngine takes a resolved EngineConfig"
        self.config = config
        self.executor = executor
        self.processor = processor
        self.clock = clock
        self.max_model_len = config.max_model_len
        cc = config.cache_config
        self.num_kv_blocks = executor.num_kv_blocks
        groups = executor.kv_cache_groups
        chunk = config.scheduler_config.max_num_batched_tokens
        needed = groups.blocks_per_token_bound(cc.block_size, self.max_model_len, chunk)
        if self.num_kv_blocks < needed:
            # vLLM's hint too: the longest max_model_len this pool could hold.
            fits = groups.max_tokens_within(cc.block_size, self.num_kv_blocks, chunk,
                                            self.max_model_len)
            raise ValueError(
                f"The KV cache holds {self.num_kv_blocks} blocks of {cc.block_size} tokens, "
                f"fewer than one request of max_model_len ({self.max_model_len}) tokens needs "
                f"({needed}): it could never run. Based on the pool, the estimated maximum "
                f"model length is {fits}: pass --max-model-len {fits} (or less), or increase "
                "--kv-cache-memory / --num-kv-blocks."
            )
        self.scheduler = Scheduler(config.scheduler_config, cc, self.num_kv_blocks,
                                   executor.num_swap_blocks, groups)
        # vLLM's start-up line, with what sliding-window groups change in it.
        logger.info("KV cache: %d blocks of %d tokens in %d group(s) (windows %s); maximum "
                    "concurrency for %d tokens per request: %.2fx", self.num_kv_blocks,
                    cc.block_size, groups.num_groups, list(groups.windows), self.max_model_len,
                    self.num_kv_blocks / needed)
        self.trace = StepTrace(config.trace_file, config.trace_format)
        # The adaptive policy's model, when it learns from the steps it plans (else None).
        step_time = config.scheduler_config.step_time
        self.step_model = step_time if isinstance(step_time, LearnedStepTime) else None
        self._states: dict[str, _RequestState] = {}
        # For the next step's record (the timeline): requests added since the previous step
        # ([id, arrival, prompt tokens]), and those finished in it or aborted since.
        self._arrived: list[list] = []
        self._finished: list[str] = []
        self._step_count = 0
        self._next_id = 0

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> LLMEngine:
        """The engine on the real model. `loaded` lets several engines share one set of
        weights (tests, sweeps): the model is stateless, each engine owns its KV cache."""
        # Imported here, not at the top: the simulator builds this module's engine on a cost
        # model and must not pay for importing torch and the model code.
        from chunkserve.engine.model_runner import ModelRunner
        from chunkserve.model.factory import load_configured

        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is several engines behind one server: "
                             "`chunkserve serve --data-parallel-size`; an engine is one")
        executor: Executor
        if config.parallel_config.tensor_parallel_size > 1:
            executor, loaded, config = _tensor_parallel(config, loaded)
            try:
                warm_start_step_model(loaded, config, executor)
            except BaseException:
                executor.close()
                raise
        else:
            if loaded is None:
                loaded = load_configured(config.model_config)
            model = loaded.model
            config = config.resolve(loaded.max_model_len, device=model.device.type,
                                    dtype=str(model.dtype).removeprefix("torch."))
            warm_start_step_model(loaded, config)
            executor = ModelRunner.from_config(model, config)
        eos = loaded.config.eos_token_ids or None
        processor = Processor(config.max_model_len, loaded.config.vocab_size, loaded.tokenizer,
                              eos)
        try:
            return cls(config, executor, processor, clock)
        except BaseException:
            executor.close()  # worker processes must not outlive a refused config
            raise

    @classmethod
    def from_kwargs(
        cls,
        loaded: LoadedModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> LLMEngine:
        return cls.from_config(EngineConfig.from_kwargs(**kwargs), loaded=loaded, clock=clock)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        """The offline entry: runs the processor, then adds the request."""
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        request = self.processor.process_inputs(
            request_id, prompt, params or SamplingParams(), arrival_time, priority
        )
        self.add_engine_request(request)
        return request_id

    def add_engine_request(self, request: EngineRequest) -> None:
        """Adds a request the processor already checked (the server's path)."""
        rid = request.request_id
        if rid in self._states:
            raise ValueError(f"request id {rid!r} is already in use")
        arrival = self.clock() if request.arrival_time is None else request.arrival_time
        params = request.sampling_params
        req = Request(rid, request.prompt_token_ids, params, arrival, request.eos_token_ids,
                      request.priority)
        tokenizer = self.processor.tokenizer
        detok = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
                 if tokenizer is not None else None)
        state = _RequestState(req, request.prompt, detok, RequestMetrics(arrival))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(request.prompt_token_ids)
        if params.structured_outputs is not None:
            grammars = self.processor.grammars()
            grammar = request.grammar or grammars.compile(params.structured_outputs)
            state.matcher = grammars.matcher(grammar)
        self._states[rid] = state
        self.scheduler.add_request(req)
        self._arrived.append([rid, arrival, len(request.prompt_token_ids)])

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            if self._states.pop(rid, None) is not None:
                self._finished.append(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The engine's state now: what the server's gauges and admission read."""
        kv = self.scheduler.kv.stats()
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), kv.usage,
                           kv.internal_fragmentation)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One step. A failure of one request's own (its row of the logits, its grammar, its
        detokenizer) ends that request alone, with a final output whose `error` says why; only
        a failure of the step itself raises StepError, naming every request it ran."""
        start = self.clock()
        out = self.scheduler.schedule()
        try:
            fill_time, failed = self._fill_grammar_masks(out)
            for sr in out.scheduled:
                if not sr.is_decode:  # a decode was scheduled before, by definition
                    self._states[sr.request.request_id].metrics.on_scheduled(start)
            result = self.executor.execute(out)
            now = self.clock()
            for rid, (first, entries) in result.prompt_logprobs.items():
                prompt_state = self._states.get(rid)
                if prompt_state is not None and prompt_state.prompt_logprobs is not None:
                    prompt_state.prompt_logprobs[first : first + len(entries)] = entries
            failed.update(result.failed)
            sampled = ({rid: t for rid, t in result.sampled.items() if rid not in failed}
                       if failed else result.sampled)
            updated = self.scheduler.update_from_output(out, sampled)
            outputs = self._process_all(updated, now, result.logprobs, failed)
        except Exception as e:
            # Blocks indexed for this step's tokens may never have received their KV: forget
            # every cached prefix rather than serve one that was never written.
            self.scheduler.reset_prefix_cache()
            raise StepError([s.request.request_id for s in out.scheduled]) from e
        record = step_record(self._step_count, start, self.clock() - start, out,
                             grammar_mask_time=fill_time + result.grammar_time,
                             arrived=self._arrived, finished=self._finished)
        self._arrived, self._finished = [], []
        if self.step_model is not None:
            state = self.step_model.observe(out.scheduled, record.duration)
            if state is not None:
                record = replace(record, predicted_duration=state.predicted,
                                 step_model_error=state.error,
                                 step_model_coefficients=state.coefficients)
        self.trace.add(record)
        self._step_count += 1
        return StepResult(outputs, record, out.scheduled)

    def _process_all(self, updated: list[Request], now: float,
                     logprobs: dict[str, list[tuple[int, float]]],
                     failed: dict[str, RequestError]) -> list[RequestOutput]:
        """The step's outputs: each updated request's, then a final error output for each that
        failed alone (in the executor, or here while its token was processed)."""
        outputs = []
        for req in updated:
            try:
                output = self._process(req, now, logprobs.get(req.request_id))
            except Exception as e:  # noqa: BLE001 - this request's detokenizer or grammar
                logger.exception("processing request %s's token failed", req.request_id)
                failed[req.request_id] = RequestError(f"processing its output failed: {e!r}")
                continue
            if output is not None:
                outputs.append(output)
        for rid, error in failed.items():
            output = self._fail_request(rid, error, now)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_request(self, request_id: str, error: RequestError, now: float
                      ) -> RequestOutput | None:
        """Ends one request alone (finish_reason "error"); its final output, whose error names
        it. None if it is gone already."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        req = state.request
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
        req.status = RequestStatus.FINISHED_ERROR  # also when its last token had finished it
        self._finished.append(request_id)
        state.metrics.finished_time = now
        logger.warning("request %s failed alone: %s", request_id, error.message)
        completion = CompletionOutput(index=0, text="", token_ids=list(req.output_token_ids),
                                      finish_reason=req.status.finish_reason)
        return RequestOutput(request_id, state.prompt, req.prompt_token_ids, [completion], True,
                             state.metrics,
                             error=RequestError(f"request {request_id}: {error.message}",
                                                error.client_error))

    def fail_step(self, error: StepError) -> list[RequestOutput]:
        """After a StepError: ends the step's requests (their final outputs, with the error),
        then checks that the scheduler and the KV pool still add up, so that the next step
        does not run on broken books (a RuntimeError when they do not: the engine must not go
        on). The engine's other requests go on. Re-raises `error` when its cause is a
        FatalExecutorError: no step can run any more."""
        cause = error.__cause__ or error
        if isinstance(cause, FatalExecutorError):
            raise error
        why = RequestError(f"the engine step it was in failed: {cause!r}")
        now = self.clock()
        outputs = [self._fail_request(rid, why, now) for rid in error.request_ids]
        self.scheduler.check_consistency()
        return [out for out in outputs if out is not None]

    def _fill_grammar_masks(self, out: SchedulerOutput) -> tuple[float, dict[str, RequestError]]:
        """The token masks of this step's structured rows that sample (only those: a prefill
        chunk that does not catch up costs nothing); returns the seconds the fill took, for
        the step's record (0, and nothing timed, when no row has a grammar), and the requests
        whose grammar could not fill a mask (they fail alone)."""
        if not self.processor.has_grammars:
            return 0.0, {}
        rows = [(sr.request.request_id, self._states[sr.request.request_id].matcher)
                for sr in out.scheduled if sr.samples]
        rows = [(rid, m) for rid, m in rows if m is not None]
        if not rows:
            return 0.0, {}
        fill_start = time.perf_counter()  # not self.clock: a simulated clock stands still
        mask, bad = self.processor.grammars().fill([m for _, m in rows])
        out.grammar_bitmask = {rid: mask[i] for i, (rid, _) in enumerate(rows)}
        failed = {rows[i][0]: RequestError(why, client_error=True) for i, why in bad.items()}
        return time.perf_counter() - fill_start, failed

    def _process(
        self, req: Request, now: float, logprobs: list[tuple[int, float]] | None
    ) -> RequestOutput | None:
        """Records the request's new token; its output, unless it asked for the final one
        only and is not finished (building an output per token is most of a simulated step).
        The request's state is dropped only once its output is built: an error on the way
        leaves it for _fail_request."""
        state = self._states[req.request_id]
        if logprobs is not None:
            state.logprobs.append(logprobs)
        m = state.metrics
        m.on_token(now)
        detok = state.detokenizer
        stop = detok.update(req.output_token_ids[-1:]) if detok is not None else None
        if state.matcher is not None:
            from chunkserve.engine.grammar import advance  # llguidance: only when used

            if advance(state.matcher, req.output_token_ids[-1]) and not req.status.finished:
                # The grammar is complete: nothing but the end of text could follow.
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        if stop is not None:
            req.stop_reason = stop
            if req.status.finished:  # also hit a length/EOS limit: the stop string wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        finished = req.status.finished
        m.num_preemptions = req.num_preemptions
        if not finished and req.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        completion = CompletionOutput(
            index=0,
            text=detok.output_text if detok is not None else "",
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(state.logprobs) if req.sampling_params.logprobs is not None else None,
            delta_text=detok.get_next_delta(finished) if detok is not None else "",
        )
        if finished:
            m.finished_time = now
            del self._states[req.request_id]
            self._finished.append(req.request_id)
        return RequestOutput(
            req.request_id, state.prompt, req.prompt_token_ids, [completion], finished, m,
            num_cached_tokens=max(0, req.num_cached_tokens),
            prompt_logprobs=(list(state.prompt_logprobs)
                             if state.prompt_logprobs is not None else None),
        )

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (vLLM's reset_prefix_cache); call between steps."""
        return self.scheduler.reset_prefix_cache()

    def commit_kv_memory(self) -> None:
        self.executor.commit_kv_memory()

    def close(self) -> None:
        self.trace.close()
        self.executor.close()


def _tensor_parallel(config: EngineConfig, loaded: LoadedModel | None
                     ) -> tuple[Executor, LoadedModel, EngineConfig]:
    """The ranks' executor, rank 0's load and the config resolved against it. Each rank loads
    its own shard, so a model loaded beforehand cannot be shared."""
    from chunkserve.engine.tp.executor import TensorParallelExecutor

    if loaded is not None:
        raise ValueError("tensor parallelism loads the model on every rank: pass the model "
                         "name, not a loaded model")
    executor = TensorParallelExecutor(config, config.parallel_config.tensor_parallel_size)
    return executor, executor.loaded, executor.config


class _Borrowed:
    """An executor lent to the probe's scratch engine: its steps run there, its close() does
    not close it."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.num_kv_blocks = executor.num_kv_blocks
        self.num_swap_blocks = executor.num_swap_blocks
        self.kv_cache_groups = executor.kv_cache_groups
        self.execute = executor.execute
        self.commit_kv_memory = executor.commit_kv_memory

    def close(self) -> None:
        pass


def _scratch_engine(loaded: LoadedModel, scratch: EngineConfig,
                    executor: Executor | None) -> LLMEngine:
    """The probe's engine: over the loaded model with a runner and KV pool of its own, or on
    `executor` (a tensor-parallel group's, whose every rank must run the probe's steps; a
    second group would load the model again). The probe's requests are gone when it ends."""
    if executor is None:
        return LLMEngine.from_config(scratch, loaded=loaded)
    mc = scratch.model_config
    resolved = scratch.resolve(loaded.max_model_len, device=mc.device, dtype=mc.dtype)
    processor = Processor(resolved.max_model_len, loaded.config.vocab_size, loaded.tokenizer,
                          loaded.config.eos_token_ids or None)
    return LLMEngine(resolved, _Borrowed(executor), processor)


def warm_start_step_model(loaded: LoadedModel, config: EngineConfig,
                          executor: Executor | None = None) -> None:
    """Readies a learning step-time model before the scheduler plans with it: from its cache,
    else by the start-up probe (engine/step_probe.py), run on `executor` when given (tensor
    parallelism: every rank steps). Logs the choice the engine made."""
    sc = config.scheduler_config
    step_time = sc.step_time
    if not isinstance(step_time, LearnedStepTime):
        return
    from chunkserve.engine.step_probe import probe_identity, run_probe

    t0 = time.monotonic()
    def probe() -> list[StepObservation]:
        return run_probe(lambda scratch: _scratch_engine(loaded, scratch, executor), config,
                         loaded.config.vocab_size,
                         group_layers(loaded.model.layer_windows()).num_groups)

    how = step_time.warm_start(probe_identity(loaded, config), probe)
    decode = step_time(PlannedStep(1, 1, 0, 0))
    logger.info(
        "chunk policy: adaptive on the engine's own step-time model (%s, %.1f s); token-gap "
        "target %.0f ms%s, cap %d tokens, min chunk %d; predicted decode-only step %.1f ms",
        how, time.monotonic() - t0, sc.target_s * 1e3,
        "" if sc.target_itl_ms is not None else " (default)", sc.max_num_batched_tokens,
        sc.min_chunk_tokens, decode * 1e3)
