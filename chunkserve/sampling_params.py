"""Per-request sampling and stopping parameters (vLLM's `SamplingParams` names).

A leaf module: it imports nothing from chunkserve, so `core/` may depend on it.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Integers reach the engine as torch int64 (seeds, top-k): one out of this range used to fail
# the whole engine step ("Overflow when unpacking long long"). vLLM bounds `seed` the same way.
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Bounds tighter than vLLM's (which only asks temperature >= 0 and repetition_penalty > 0):
# within them a bf16/fp32 logit stays finite through every sampling rule. A denormal
# repetition_penalty is not a penalty; it divided logits into inf and, before the sampler
# guarded itself, failed every request of its step.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# What one request may ask the detokenizer to watch for on every token (OpenAI allows 4 stop
# strings; vLLM sets no limit).
MAX_STOP_STRINGS = 256
MAX_STOP_LENGTH = 4096
MAX_STOP_TOKEN_IDS = 1024


class RequestOutputKind(enum.Enum):
    """When the engine hands a request's output back (vLLM's names)."""

    CUMULATIVE = 0  # every step that samples a token: the whole output so far (streaming)
    FINAL_ONLY = 2  # once, when the request finishes: offline generation and benchmarks


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON
    schema (a dict or its JSON text), a regex, a choice of strings, a grammar (Lark, or GBNF
    as llama.cpp writes it), or `json_object` (any JSON object). Checked here for shape only;
    the engine's Processor compiles it (engine/grammar.py) and refuses what does not compile.

    `strict` (OpenAI's json_schema `strict`; a tool's `function.strict`): True, a schema keyword
    the grammar cannot enforce is an error; False, it is left unenforced (with a warning in the
    log) and the rest of the schema still holds. The schema's structure is always enforced."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, "
                             f"grammar or json_object; got {given or 'none'}.")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string.")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("json must be a JSON schema: an object or its JSON text.")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (vLLM accepts both)
    min_p: float = 0.0
    # Penalties (vLLM's definitions; see engine/sampler.py): presence and frequency over the
    # output tokens, repetition over prompt and output tokens. The defaults are "off".
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit, clamped to [-100, 100] like vLLM's OpenAI layer.
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    # Per prompt token (from the second on): its logprob and the top-`prompt_logprobs` ones.
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match a grammar (engine/grammar.py): a mask on every sampled token.
    structured_outputs: StructuredOutputsParams | None = None
    # Greedy when temperature is ~0; kept as a property so there is one source of truth.

    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self._verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _verify(self) -> None:
        """Every numeric field in its range, checked before the request is queued: a value
        out of range is a ValueError naming the field and the range (the server's 400). Each
        range is vLLM's or tighter, so that no value can turn the sampler's logits into
        inf/NaN (repetition_penalty=1e-320 divided them into inf, for one)."""
        self._verify_lengths()
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or at least 1 (and at most {INT64_MAX}), "
                f"got {self.top_k}."
            )
        _check_range("min_p", self.min_p, 0.0, 1.0)
        self._verify_penalties()
        if self.seed is not None and (
            not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= INT64_MAX):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        self._verify_stops()

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX
        ):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )

    def _verify_stops(self) -> None:
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got "
                             f"{len(self.stop_strings)}.")
        if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LENGTH
               for s in self.stop_strings):
            raise ValueError(f"stop strings must be non-empty strings of at most "
                             f"{MAX_STOP_LENGTH} characters.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}.")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT64_MAX}].")

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                     MAX_REPETITION_PENALTY)

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must count this request's tokens (any penalty is not "off")."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: object, low: float, high: float,
                 low_open: bool = False) -> None:
    """A ValueError naming `name` and the range unless `value` is a number in [low, high]
    ((low, high] with `low_open`); NaN is in no range."""
    try:
        number = float(value) if _is_number(value) else math.nan  # type: ignore[arg-type]
    except OverflowError:  # an int past float's range
        number = math.nan
    ok = (low < number if low_open else low <= number) and number <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}.")


def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
    """Int keys (JSON object keys arrive as strings), finite values clamped to [-100, 100].

    vLLM clamps in its OpenAI layer; doing it here gives every entry point the same bounds.
    """
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {bias!r}.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.strip().lstrip("-").isdecimal():
            token = int(key)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= INT64_MAX:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}.")
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} "
                             f"for token {token}.")
        out[token] = min(100.0, max(-100.0, float(value)))
    return out
