"""Prometheus metrics with vLLM's names, labels and buckets, so existing vLLM dashboards and
benchmark scrapers work against chunkserve unchanged (docs/conventions.md, "vLLM Prometheus
metrics"). A few `chunkserve:` metrics add what vLLM does not expose.

The engine thread calls the observe/set methods once per step or per output, so label children
are bound once in `__init__` and the hot path does only lock-protected adds. `render` and
`count_rejected` run on the HTTP side; prometheus_client's values are thread-safe.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from chunkserve.engine.engine_loop import LoopEvent
from chunkserve.engine.trace import StepRecord
from chunkserve.outputs import RequestOutput

# vLLM's exact buckets: dashboards compute quantiles from `le` values, so they must match.
TTFT_BUCKETS: list[float] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
ITL_BUCKETS: list[float] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
REQUEST_LATENCY_BUCKETS: list[float] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]
ITERATION_TOKENS_BUCKETS: list[float] = [
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
]
# Ours: a step ranges from ~1 ms (tiny decode batch) to tens of seconds (huge prefill on CPU).
STEP_DURATION_BUCKETS: list[float] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
]

# "error": a request that failed alone (vLLM's FinishReason.ERROR).
FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
# vllm:num_requests_rejected_total{reason}: 503s from admission (the waiting cap is full, the
# server is shutting down, the engine is not running), 400s for a request bigger than the cap
# could ever hold, and connections refused at the HTTP layer's connection cap.
REJECT_REASONS: tuple[str, ...] = (
    "queue_full", "shutting_down", "engine_dead", "too_many_sequences", "connection_limit",
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _EngineGauges:
    """One engine's children of the per-engine gauge families."""

    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    fragmentation: Gauge
    token_budget: Gauge
    model_error: Gauge
    labels: tuple[str, str]  # (model_name, engine)
    waiting_tracked: bool = False


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, num_kv_blocks: int | None = None,
                 block_size: int | None = None, cache_dtype: str = "auto") -> None:
        self.model_name = model_name
        # A private registry: several servers (or tests) in one process would otherwise collide
        # on the global default registry's duplicate-name check.
        self.registry = CollectorRegistry()
        self._make_state_metrics(num_kv_blocks, block_size, cache_dtype)
        self._make_request_metrics(max_model_len)
        self._make_step_metrics()
        self._make_rejected_metrics()
        self._engine(0)  # engine 0's series exist (at 0) before its first step

    # Each metric's child for this server's model_name label is bound once: `.labels()` costs a
    # dict lookup under a lock per call.
    def _gauge(self, name: str, doc: str) -> Gauge:
        """A per-engine gauge family: vLLM labels the engine's state with `engine` (its index
        under --data-parallel-size, "0" for one engine); bound per engine in `_engine`."""
        return Gauge(name, doc, ["model_name", "engine"], registry=self.registry)

    def _counter(self, name: str, doc: str) -> Counter:
        # prometheus_client appends "_total" to counter samples; passing the bare name gives
        # exactly vLLM's exposed `..._total` names.
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _make_state_metrics(self, num_kv_blocks: int | None, block_size: int | None,
                            cache_dtype: str) -> None:
        """The scheduler's state (gauges) and the engine's token and preemption counters."""
        self._running = self._gauge("vllm:num_requests_running", "Requests in the running batch.")
        self._waiting = self._gauge(
            "vllm:num_requests_waiting",
            "Requests admitted and not yet running: queue places reserved by admission, "
            "requests on their way to the engine and its waiting queue (what "
            "--max-waiting-requests limits).")
        self._kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.")
        self._fragmentation = self._gauge(
            "chunkserve:kv_cache_internal_fragmentation_tokens",
            "Allocated KV slots not holding a token (partly filled last blocks).")
        if num_kv_blocks is not None:
            # vLLM's info gauge (value 1, facts in labels): with kv_cache_usage_perc it gives
            # the blocks in use, which a usage fraction alone hides on a large pool.
            Gauge("vllm:cache_config_info", "The KV cache's configuration.",
                  ["block_size", "num_gpu_blocks", "cache_dtype"], registry=self.registry,
                  ).labels(str(block_size), str(num_kv_blocks), cache_dtype).set(1)
        self._preemptions = self._counter("vllm:num_preemptions", "Cumulative preemptions.")
        self._prompt_tokens = self._counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self._generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens.")
        # Token counts, vLLM's names: hits / queries is the prefix cache's hit rate.
        self._prefix_queries = self._counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self._prefix_hits = self._counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")

    def _make_request_metrics(self, max_model_len: int) -> None:
        """Per finished request: outcome, latencies and lengths."""
        self._success_family = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        # Pre-create all three so each series exists (at 0) before the first request ends, as
        # vLLM does; dashboards' rate() needs the series to exist.
        self._success: dict[str, Counter] = {
            r: self._success_family.labels(self.model_name, r) for r in FINISHED_REASONS
        }
        h = self._histogram
        self._ttft = h("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._itl = h("vllm:inter_token_latency_seconds",
                      "Gap between consecutive output tokens.", ITL_BUCKETS)
        self._tpot = h("vllm:request_time_per_output_token_seconds",
                       "Per request: mean time per output token after the first.", ITL_BUCKETS)
        self._e2e = h("vllm:e2e_request_latency_seconds", "Arrival to finish.",
                      REQUEST_LATENCY_BUCKETS)
        self._queue = h("vllm:request_queue_time_seconds", "Arrival to first scheduled.",
                        REQUEST_LATENCY_BUCKETS)
        self._prefill = h("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                          REQUEST_LATENCY_BUCKETS)
        self._decode = h("vllm:request_decode_time_seconds", "First token to finish.",
                         REQUEST_LATENCY_BUCKETS)
        len_buckets = build_1_2_5_buckets(max_model_len)
        self._request_prompt_tokens = h("vllm:request_prompt_tokens",
                                        "Prompt length per request.", len_buckets)
        self._request_generation_tokens = h("vllm:request_generation_tokens",
                                            "Output tokens per finished request.", len_buckets)

    def _make_step_metrics(self) -> None:
        """Per engine step: tokens and wall time."""
        h = self._histogram
        # A histogram whose name ends in "_total" is exposed verbatim (only counters get the
        # suffix treatment), giving vLLM's `vllm:iteration_tokens_total_bucket` etc.
        self._iteration_tokens = h("vllm:iteration_tokens_total",
                                   "Tokens (prefill + decode) per engine step.",
                                   ITERATION_TOKENS_BUCKETS)
        self._step_duration = h("chunkserve:step_duration_seconds",
                                "Wall time of one engine step.", STEP_DURATION_BUCKETS)
        # Observed every step, zeros included, so count == steps and the le="1" bucket shows how
        # often a step had no prefill (or no decode) work.
        self._step_prefill_tokens = h("chunkserve:step_prefill_tokens",
                                      "Prefill tokens per engine step.", ITERATION_TOKENS_BUCKETS)
        self._step_decode_tokens = h("chunkserve:step_decode_tokens",
                                     "Decode tokens per engine step.", ITERATION_TOKENS_BUCKETS)
        self._token_budget = self._gauge(
            "chunkserve:step_token_budget",
            "The last step's token budget: --max-num-batched-tokens, or the adaptive policy's "
            "choice (decodes plus the prefill chunk it sized).")
        # The learning step-time model (adaptive policy without --cost-model): its fit and how
        # far off it has been. Series appear with the first step that reports them.
        self._model_error = self._gauge(
            "chunkserve:step_model_relative_error",
            "Median |predicted - measured| / measured step time over recent steps.")
        self._model_coefficient = Gauge(
            "chunkserve:step_model_coefficient",
            "The step-time model's fitted seconds per unit of each cost-model term.",
            ["model_name", "engine", "term"], registry=self.registry)
        # Structured outputs (the trace's num_grammar_rows, grammar_mask_time): vLLM exports
        # no such series, so chunkserve's prefix with vLLM's unit and _total conventions.
        self._grammar_rows = self._counter(
            "chunkserve:grammar_masked_rows", "Sampled rows constrained by a grammar mask.")
        self._grammar_seconds = self._counter(
            "chunkserve:grammar_mask_seconds",
            "Time filling grammar masks and applying them to the logits.")
        self._engines: dict[int, _EngineGauges] = {}

    def _make_rejected_metrics(self) -> None:
        self._rejected_family = Counter(
            "vllm:num_requests_rejected", "Requests refused before reaching the engine, by reason.",
            ["model_name", "reason"], registry=self.registry,
        )
        # Every known reason exists at 0 from the start, as request_success does.
        self._rejected: dict[str, Counter] = {
            r: self._rejected_family.labels(self.model_name, r) for r in REJECT_REASONS
        }

    def count_rejected(self, reason: str) -> None:
        """One request refused for `reason` (REJECT_REASONS; another gets a series of its own).
        Any thread."""
        child = self._rejected.get(reason)
        if child is None:
            child = self._rejected[reason] = self._rejected_family.labels(self.model_name, reason)
        child.inc()

    def _engine(self, index: int) -> _EngineGauges:
        """Engine `index`'s gauge children, bound once (a dict lookup per call after that)."""
        gauges = self._engines.get(index)
        if gauges is None:
            labels = (self.model_name, str(index))
            gauges = self._engines[index] = _EngineGauges(
                self._running.labels(*labels), self._waiting.labels(*labels),
                self._kv_usage.labels(*labels), self._fragmentation.labels(*labels),
                self._token_budget.labels(*labels), self._model_error.labels(*labels), labels)
        return gauges

    def on_event(self, index: int, ev: LoopEvent) -> None:
        """An engine loop's event (frontend/async_engine.py's observers), on any thread."""
        if ev.record is not None:
            self.observe_step(ev.record, index)
        for _, out, new in ev.outputs:
            self.observe_output(out, new)
        for _ in ev.aborted:
            self.observe_aborted()
        if ev.stats is not None:
            s = ev.stats
            self.set_state(index, s.num_running, s.num_waiting, s.kv_usage,
                           s.kv_internal_fragmentation)

    def track_waiting(self, index: int, source: Callable[[], float]) -> None:
        """Engine `index`'s vllm:num_requests_waiting reads `source()` at every scrape from now
        on, and `set_state`'s `num_waiting` is ignored: the server's gauge is the count
        admission compares with --max-waiting-requests (AsyncEngine), never a copy of it."""
        gauges = self._engine(index)
        gauges.waiting.set_function(source)
        gauges.waiting_tracked = True

    def set_state(self, index: int, num_running: int, num_waiting: int, kv_usage: float,
                  fragmentation_tokens: int) -> None:
        gauges = self._engine(index)
        gauges.running.set(num_running)
        if not gauges.waiting_tracked:
            gauges.waiting.set(num_waiting)
        gauges.kv_usage.set(kv_usage)
        gauges.fragmentation.set(fragmentation_tokens)

    def observe_step(self, record: StepRecord, index: int = 0) -> None:
        # vLLM does not observe idle iterations; an empty step would only pile up in le="1".
        if record.num_tokens > 0:
            self._iteration_tokens.observe(record.num_tokens)
        self._step_duration.observe(record.duration)
        self._step_prefill_tokens.observe(record.num_prefill_tokens)
        self._step_decode_tokens.observe(record.num_decode_tokens)
        if record.num_preemptions:
            self._preemptions.inc(record.num_preemptions)
        if record.prefix_cache_queries:
            self._prefix_queries.inc(record.prefix_cache_queries)
            self._prefix_hits.inc(record.prefix_cache_hits)
        if record.num_grammar_rows:
            self._grammar_rows.inc(record.num_grammar_rows)
            self._grammar_seconds.inc(record.grammar_mask_time)
        gauges = self._engine(index)
        if record.token_budget is not None:
            gauges.token_budget.set(record.token_budget)
        if record.step_model_error is not None:
            gauges.model_error.set(record.step_model_error)
        for term, value in (record.step_model_coefficients or {}).items():
            self._model_coefficient.labels(*gauges.labels, term).set(value)

    def observe_output(self, out: RequestOutput, num_new_tokens: int) -> None:
        """Account one emitted RequestOutput; `num_new_tokens` were added since its last one.

        A finished output with finish_reason "abort" is counted here; call `observe_aborted`
        only for aborts that emit no final RequestOutput, or the abort is counted twice.
        """
        m = out.metrics
        times = m.token_times
        n = len(times)
        if num_new_tokens > 0:
            self._generation_tokens.inc(num_new_tokens)
            # One ITL per gap ending at a new token; the first token has no predecessor (its
            # latency is TTFT), hence the max(1, ...).
            for i in range(max(1, n - num_new_tokens), n):
                self._itl.observe(times[i] - times[i - 1])
            if n == num_new_tokens:  # this output carries the request's first token(s)
                if m.ttft is not None:
                    self._ttft.observe(m.ttft)
                num_prompt = len(out.prompt_token_ids)
                self._prompt_tokens.inc(num_prompt)
                self._request_prompt_tokens.observe(num_prompt)

        if not out.finished:
            return
        if m.e2e_latency is not None:
            self._e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self._queue.observe(m.queue_time)
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            self._prefill.observe(m.first_token_time - m.first_scheduled_time)
        if m.finished_time is not None and m.first_token_time is not None:
            self._decode.observe(m.finished_time - m.first_token_time)
        tpot = m.tpot  # None unless > 1 output token: TPOT is undefined for a single token
        if tpot is not None:
            self._tpot.observe(tpot)
        self._request_generation_tokens.observe(n)
        reason = (out.outputs[0].finish_reason if out.outputs else None) or "stop"
        self._success_counter(reason).inc()

    def observe_aborted(self, num_prompt_tokens: int | None = None) -> None:
        """An abort that emitted no final RequestOutput (e.g. the client went away).

        vLLM counts aborts under request_success_total{finished_reason="abort"}. Pass
        `num_prompt_tokens` when the request never got a first token, so request_prompt_tokens
        still sees every request's prompt (those with a first token were observed already).
        """
        self._success["abort"].inc()
        if num_prompt_tokens is not None:
            self._request_prompt_tokens.observe(num_prompt_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _success_counter(self, reason: str) -> Counter:
        # Unknown reasons get their own series rather than being dropped or mislabelled.
        child = self._success.get(reason)
        if child is None:
            child = self._success[reason] = self._success_family.labels(self.model_name, reason)
        return child
