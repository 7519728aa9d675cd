"""OpenAI/vLLM-compatible request models: the base every request shares, the sampling fields of
/v1/completions and /v1/chat/completions, CompletionRequest and DetokenizeRequest.

Chat requests (and /tokenize, which takes chat messages) are in serve/openai/chat_protocol.py; the
fields refused or accepted as harmless in serve/openai/refused_fields.py; the error body a failed check
becomes in serve/http/errors.py.

Sampling values (temperature, top_p, ...) are deliberately not range-checked here:
`SamplingParams` owns those rules, and `to_sampling_params` lets its ValueError through for the
server to turn into a 400. What is checked here is what no engine rule covers: JSON floats must
be finite, text must be valid Unicode (JSON can carry a lone surrogate, `"\\ud800"`, which no
tokenizer or UTF-8 encoder accepts), and the fields the engine never sees (n, priority).
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from chunkserve.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    StructuredOutputsParams,
)
from chunkserve.serve.http.errors import encodable, field_error
from chunkserve.serve.openai.refused_fields import check_refused_fields, known_extra_field
from chunkserve.serve.openai.structured_fields import structured_outputs_of

# vLLM's default --max-logprobs; larger requests are rejected up front.
MAX_LOGPROBS = 20
# vLLM's VLLM_MAX_N_SEQUENCES default: the most sequences one request may ask for (n × prompts).
MAX_SEQUENCES = 16384
# OpenAI's bounds on a logit_bias value; vLLM clamps to them rather than refusing.
LOGIT_BIAS_LIMIT = 100.0

Prompt = str | list[int]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def find_lone_surrogate(data: Any) -> tuple[str, str] | None:
    """(where, escaped char) of the first lone surrogate in any string of a parsed JSON value.

    Walks with an explicit stack: a body is at most a few MiB but may nest deeply.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    return path, ascii(value[e.start])[1:-1]
        elif isinstance(value, dict):
            for k, v in value.items():
                key = encodable(str(k))  # the path is quoted in an error message
                stack.append((f"{path}.{key}" if path else key, k))
                stack.append((f"{path}.{key}" if path else key, v))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in reversed(list(enumerate(value))))
    return None


class BaseRequest(BaseModel):
    """What every request shares: unknown fields are kept (for a warning), numbers are finite
    and text is valid Unicode."""

    # JSON has no inf/NaN, but Python's parser accepts `Infinity`, `NaN` and `1e400`.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            where, char = found
            param = where.split(".")[0] or None
            raise field_error(f"{where or 'body'}: text must be valid Unicode, found a lone "
                              f"surrogate ({char})", param)
        return data

    def unknown_fields(self) -> list[str]:
        """Fields the client sent that we do not know: the server logs them, as vLLM does.
        Fields of REFUSED_FIELDS (here with their default value) and HARMLESS_FIELDS are known."""
        endpoint = getattr(self, "_endpoint", None)
        return sorted(k for k in self.model_extra or {} if not known_extra_field(k, endpoint))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. vLLM's continuous_usage_stats
    include_usage: bool = False


class SamplingRequest(BaseRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    _endpoint: ClassVar[str]  # which REFUSED_FIELDS apply: "completions" or "chat"

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # OpenAI's penalties ([-2, 2]) and vLLM's repetition_penalty (> 0); null means off.
    # SamplingParams checks the ranges.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # OpenAI: token ids (JSON object keys, so strings) to a bias added to the logit, clamped to
    # [-100, 100] as vLLM does; ids outside the vocabulary are the Processor's 400.
    logit_bias: dict[int, float] | None = None
    n: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # Lower runs first under --scheduling-policy priority.
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    # vLLM's: logprobs name tokens "token_id:{id}" rather than by their text.
    return_tokens_as_token_ids: bool = False
    # Structured outputs (engine/grammar.py): OpenAI's response_format, vLLM's guided_* fields
    # and their successor `structured_outputs`; at most one of them (structured_outputs()).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    _structured: StructuredOutputsParams | None = PrivateAttr(default=None)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_ids(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v  # null, or pydantic's "valid dictionary" error
        out = {}
        for token_id, bias in v.items():
            try:
                key = int(token_id)  # vLLM's conversion: " 7", "-1" and "1_0" are integers too
            except (TypeError, ValueError):
                raise field_error(f"Found token_id `{token_id}` in logit_bias but token_id must be "
                                  "an integer or string representing an integer") from None
            out[key] = bias
        return out

    @field_validator("logit_bias")
    @classmethod
    def _clamp_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return v
        return {t: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, b)) for t, b in v.items()}

    @model_validator(mode="after")
    def _refuse_unsupported_fields(self) -> SamplingRequest:
        check_refused_fields(self, self._endpoint)
        return self

    @model_validator(mode="after")
    def _one_structured_output(self) -> SamplingRequest:
        self._structured = self._structured_constraint()
        return self

    def _structured_constraint(self) -> StructuredOutputsParams | None:
        """What the output must match; chat adds what its tool_choice constrains."""
        return structured_outputs_of(self)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise field_error("must be a string or a list of strings")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise field_error("Stream options can only be defined when `stream=True`.",
                              "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,  # type: ignore[arg-type]
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            logit_bias=self.logit_bias,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self._structured,
        )


class CompletionRequest(SamplingRequest):
    _endpoint: ClassVar[str] = "completions"

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # With logprobs, the prompt tokens' logprobs come first (vLLM's prompt_logprobs).
    echo: bool = False
    # vLLM V0's best_of: that many samples per prompt, the n most likely returned (see
    # openai/endpoints.py's _best_of). Null means n.
    best_of: int | None = Field(default=None, ge=1, le=MAX_SEQUENCES)
    # vLLM's: whether a text prompt is tokenized with the model's special tokens (BOS).
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _best_of_rules(self) -> CompletionRequest:
        # vLLM V0's SamplingParams rules, and OpenAI's: best_of results cannot be streamed.
        best_of = self.best_of
        if best_of is None:
            return self
        if best_of < self.n:
            raise field_error(f"best_of must be greater than or equal to n, got n={self.n} and "
                              f"best_of={best_of}.", "best_of")
        if best_of > self.n and self.stream:
            raise field_error(f"best_of={best_of} cannot be streamed: only the best n={self.n} of "
                              "the samples are returned, which is known when all are finished. "
                              "Set best_of equal to n, or do not stream.", "best_of")
        if best_of > 1 and self.temperature is not None and self.temperature < 1e-5:
            raise field_error(f"best_of must be 1 when using greedy sampling, got {best_of}.",
                              "best_of")
        return self

    @property
    def samples_per_prompt(self) -> int:
        """How many sequences each prompt runs: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def ranks_samples(self) -> bool:
        """Whether the n best of more samples are chosen (best_of > n)."""
        return self.samples_per_prompt > self.n

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One readable error instead of pydantic's four (one per union arm).
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            if not v:
                raise field_error("must not be empty")
            if all(isinstance(p, str) for p in v) or all(_is_int(t) for t in v):
                return v
            if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v):
                if any(not p for p in v):
                    raise field_error("token lists must not be empty")
                return v
        raise field_error("must be a string, a list of strings, a list of token ids "
                          "or a list of lists of token ids")

    def prompts(self) -> list[Prompt]:
        """The prompt field as a list of single prompts (each a string or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(_is_int(t) for t in p):  # one tokenised prompt
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        logprobs = self.logprobs
        if logprobs is None and self.ranks_samples:
            logprobs = 0  # best_of ranks by the sampled tokens' logprobs; not sent back
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, logprobs, prompt_logprobs)


class DetokenizeRequest(BaseRequest):
    model: str | None = None
    tokens: list[int]
