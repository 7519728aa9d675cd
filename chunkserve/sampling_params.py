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
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if math.isinf(self.temperature):  # logits / inf turns a masked -inf into NaN
            raise ValueError(f"temperature must be finite, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or at least 1 (and at most {INT64_MAX}), "
                f"got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        self._verify_penalties()
        if self.seed is not None and (
            not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}."
            )
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < 0
        ):
            raise ValueError(
                f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs!r}."
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings.")
        if any(not isinstance(t, int) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT64_MAX}].")

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:  # also rejects NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp < math.inf:
            raise ValueError(f"repetition_penalty must be greater than zero and finite, got {rp}.")

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must count this request's tokens (any penalty is not "off")."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
