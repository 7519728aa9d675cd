"""What the engine hands back per request (vLLM's `RequestOutput` shape)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps on the engine's clock (time.monotonic for the real engine, virtual in sim)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # One timestamp per output token: inter-token latencies are their differences.
    token_times: list[float] = field(default_factory=list)

    def on_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def on_token(self, now: float) -> None:
        """One output token produced at `now` (the end of the step that sampled it)."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.token_times.append(now)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, vLLM's definition."""
        n = len(self.token_times)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(frozen=True)
class RequestError:
    """Why one request failed on its own while its step ran: its row of the logits could not be
    sampled, its grammar could not advance, its detokenizer raised. That request ends with
    finish_reason "error"; every other request of the step goes on."""

    message: str
    # True when the request's own input caused it (the server answers 400), else an internal
    # error of this request (500).
    client_error: bool = False


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # Per output token: [(sampled token, logprob), *top (token, logprob)]; None unless asked.
    logprobs: list[list[tuple[int, float]]] | None = None
    # For streaming: text released since this request's previous output. It holds back a tail
    # that could still become a stop string (which would then be cut from `text`).
    delta_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens served from the prefix cache when the request was first scheduled (vLLM's
    # field; usage.prompt_tokens_details.cached_tokens in the OpenAI responses).
    num_cached_tokens: int = 0
    # When the request asked (SamplingParams.prompt_logprobs), one entry per prompt token: None
    # for the first (nothing predicts it), then [(prompt token, logprob), *top (token, logprob)]
    # as CompletionOutput.logprobs; complete on every output from the first token on. Else None.
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Set on the final output of a request that failed alone (finish_reason "error").
    error: RequestError | None = None
