"""OpenAI/vLLM-compatible request models, error bodies and response shapes.

Requests are pydantic models that accept unknown fields (vLLM logs a warning rather than
rejecting them, and clients such as the `openai` package send extras). No field that would change
the output is ignored, though: those this server does not implement are listed in
`REFUSED_FIELDS` and are a 400 naming the field unless sent with their default value. Responses
are plain dicts built by small helpers, so the server can stream them with `json.dumps` and tests
can compare their keys to OpenAI's exactly.

Sampling values (temperature, top_p, ...) are deliberately not range-checked here:
`SamplingParams` owns those rules, and `to_sampling_params` lets its ValueError through for the
server to turn into a 400. What is checked here is what no engine rule covers: JSON floats must
be finite, text must be valid Unicode (JSON can carry a lone surrogate, `"\\ud800"`, which no
tokenizer or UTF-8 encoder accepts), and the fields the engine never sees (n, priority).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from chunkserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

if TYPE_CHECKING:  # only for the annotation: protocol.py must not need fastapi to import
    import pydantic
    from fastapi.exceptions import RequestValidationError

log = logging.getLogger("chunkserve.server")

# vLLM's default --max-logprobs; larger requests are rejected up front.
MAX_LOGPROBS = 20
# vLLM's VLLM_MAX_N_SEQUENCES default: the most sequences one request may ask for (n × prompts).
MAX_SEQUENCES = 16384
# OpenAI's bounds on a logit_bias value; vLLM clamps to them rather than refusing.
LOGIT_BIAS_LIMIT = 100.0


class Refused(NamedTuple):
    """A request field that would change the output and that this server does not implement."""

    endpoints: str  # "completions", "chat" or "both"
    accepted: tuple[Any, ...]  # values that change nothing (the default): accepted silently
    message: str  # the 400's message; "{value}" is replaced by the value sent


_STRUCTURED = ("needs structured outputs (guided decoding), which this server does not have yet "
               "(issue 31).")
_NO_PARSER = ('tool_choice={value} is not supported: it needs a tool-call parser, which this '
              'server does not have (vLLM: "auto" tool choice requires --enable-auto-tool-choice '
              'and --tool-call-parser to be set). Send tool_choice "none": the tools still reach '
              "the prompt, and the reply comes back as text.")

# Every OpenAI or vLLM request field that would change the output and is not implemented here:
# sent with any value but an accepted one (its default), it is a 400 whose `param` is the field
# (the part before the dot for a nested one), never a warning. The one place this rule lives;
# fields that change nothing (HARMLESS_FIELDS) and unknown ones are accepted, the unknown ones
# with a warning, as vLLM does.
REFUSED_FIELDS: dict[str, Refused] = {
    # OpenAI's fields.
    "suffix": Refused("completions", (None,), "suffix is not currently supported"),
    "response_format": Refused("both", (None, {"type": "text"}),
                               "response_format={value} " + _STRUCTURED),
    "tool_choice": Refused("chat", (None, "none"), _NO_PARSER),  # "auto" is the default with tools
    "functions": Refused("chat", (None,), "`functions` (deprecated by OpenAI) is not supported: "
                         'send `tools` with tool_choice "none"'),
    "function_call": Refused("chat", (None, "none"), "function_call={value} is not supported: "
                             "this server has no tool-call parser"),
    "modalities": Refused("chat", (None, ["text"]), "modalities={value} is not supported: this "
                          'server only produces text (["text"])'),
    "audio": Refused("chat", (None,), "audio is not supported: this server only produces text"),
    "reasoning_effort": Refused("chat", (None,), "reasoning_effort is not supported: template "
                                "switches such as Qwen3's enable_thinking go in "
                                "chat_template_kwargs"),
    "verbosity": Refused("chat", (None,), "verbosity is not supported"),
    "web_search_options": Refused("chat", (None,), "web_search_options is not supported: this "
                                  "server does not search the web"),
    # vLLM's extra fields.
    "best_of": Refused("chat", (None,), "best_of is only supported on /v1/completions"),
    "echo": Refused("chat", (None, False), "echo is not supported on chat completions"),
    "guided_json": Refused("both", (None,), "guided_json " + _STRUCTURED),
    "guided_regex": Refused("both", (None,), "guided_regex " + _STRUCTURED),
    "guided_choice": Refused("both", (None,), "guided_choice " + _STRUCTURED),
    "guided_grammar": Refused("both", (None,), "guided_grammar " + _STRUCTURED),
    "structured_outputs": Refused("both", (None,), "structured_outputs " + _STRUCTURED),
    "bad_words": Refused("both", (None, []), "bad_words is not supported"),
    "allowed_token_ids": Refused("both", (None,), "allowed_token_ids is not supported"),
    "logits_processors": Refused("both", (None,), "logits_processors is not supported: this "
                                 "server runs no custom logits processors"),
    "vllm_xargs": Refused("both", (None,), "vllm_xargs is not supported: this server runs no "
                          "custom logits processors"),
    "truncate_prompt_tokens": Refused("both", (None,), "truncate_prompt_tokens is not "
                                      "supported: prompts are never truncated (one too long for "
                                      "the context is a 400)"),
    "use_beam_search": Refused("both", (None, False), "use_beam_search is not supported: "
                               "this server does not do beam search"),
    "length_penalty": Refused("both", (None, 1.0), "length_penalty is only for beam search, "
                              "which is not supported; it must be 1.0"),
    "include_stop_str_in_output": Refused("both", (None, False), "include_stop_str_in_output is "
                                          "not supported: a stop string is always cut from the "
                                          "output"),
    "skip_special_tokens": Refused("both", (None, True), "skip_special_tokens=false is not "
                                   "supported: special tokens are always left out of the text"),
    "spaces_between_special_tokens": Refused("both", (None, True), "spaces_between_special_tokens"
                                             "=false is not supported"),
    "prompt_logprobs": Refused("both", (None,), "prompt_logprobs is not supported as a field: "
                               "on /v1/completions, send `echo` with `logprobs` for the prompt "
                               "tokens' logprobs"),
    "return_token_ids": Refused("both", (None, False), "return_token_ids is not supported"),
    "stream_options.continuous_usage_stats": Refused(
        "both", (None, False), "stream_options.continuous_usage_stats is not supported: usage "
        "comes in the last chunk (include_usage)"),
}
# Known fields that cannot change the output (bookkeeping, or features that only act through a
# refused field, as parallel_tool_calls does through tool_choice): accepted without a warning.
HARMLESS_FIELDS = frozenset({
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "prediction",
    "parallel_tool_calls", "request_id", "cache_salt",
})
_MISSING = object()

Prompt = str | list[int]
# Engine logprobs for one generated position: [(sampled id, logprob), *top-k (id, logprob)].
TokenLogprobs = Sequence[tuple[int, float | None]]
# Renders one token id as text (e.g. `lambda t: tokenizer.decode([t])`).
TokenRenderer = Callable[[int], str | None]


def _error(message: str, param: str | None = None) -> PydanticCustomError:
    # A custom error (not ValueError) keeps pydantic's "Value error, " prefix off the message,
    # and ctx carries the param name for model-level checks, whose loc is empty.
    return PydanticCustomError("value_error", message, {"param": param} if param else None)


def _named_function(item: dict[str, Any], what: str) -> dict[str, Any]:
    """The `function` object of a tool or tool call, which must be of type "function" and name
    its function."""
    function = item.get("function")
    if item.get("type", "function") != "function" or not isinstance(function, dict):
        raise _error(f'only {what}s of type "function", with a `function` object, are supported')
    if not isinstance(function.get("name"), str):
        raise _error(f"a {what}'s function needs a string `name`")
    return function


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field_value(model: BaseModel, path: str) -> Any:
    """The value a request sent for a (dotted) field name, declared or extra; _MISSING if none."""
    value: Any = model
    for name in path.split("."):
        if isinstance(value, BaseModel):
            if name in type(value).model_fields:
                value = getattr(value, name)
            else:
                value = (value.model_extra or {}).get(name, _MISSING)
        elif isinstance(value, dict):
            value = value.get(name, _MISSING)
        else:
            return _MISSING
        if value is _MISSING:
            return value
    return value


def _describe(value: Any) -> str:
    """A value for an error message: a named function as `function "f"`, the rest as JSON."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return f'function "{value["function"]["name"]}"'
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:200] + "..."


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
                key = _encodable(str(k))  # the path is quoted in an error message
                stack.append((f"{path}.{key}" if path else key, k))
                stack.append((f"{path}.{key}" if path else key, v))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in reversed(list(enumerate(value))))
    return None


class _Request(BaseModel):
    # JSON has no inf/NaN, but Python's parser accepts `Infinity`, `NaN` and `1e400`.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            where, char = found
            param = where.split(".")[0] or None
            raise _error(f"{where or 'body'}: text must be valid Unicode, found a lone surrogate "
                         f"({char})", param)
        return data

    def unknown_fields(self) -> list[str]:
        """Fields the client sent that we do not know: the server logs them, as vLLM does.
        Fields of REFUSED_FIELDS (here with their default value) and HARMLESS_FIELDS are known."""
        endpoint = getattr(self, "_endpoint", None)
        return sorted(k for k in self.model_extra or {} if k not in HARMLESS_FIELDS and not (
            k in REFUSED_FIELDS and REFUSED_FIELDS[k].endpoints in ("both", endpoint)))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. vLLM's continuous_usage_stats
    include_usage: bool = False


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message as a chat template sees it, kept as vLLM keeps it (its chat_utils
    `_parse_chat_message_content` and `_postprocess_messages`): text content joined into one
    string (`null` becomes "", as vLLM's "string" content format has it: templates such as
    Qwen3's fail on an assistant turn without content), `name`, an assistant's `tool_calls`
    (arguments decoded into an object) and reasoning, a tool message's `tool_call_id`."""

    model_config = ConfigDict(extra="allow")  # other OpenAI fields are tolerated, not used
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # vLLM's older name for `reasoning`

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        # Checked before the union so a bad part yields one clear error, not one per union arm.
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise _error("must be a string or a list of content parts")
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _error("only text content is supported")
            if not isinstance(part.get("text"), str):
                raise _error("text content parts need a string `text`")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls_shape(cls, v: Any) -> Any:
        # OpenAI's shape: [{"id", "type": "function", "function": {"name", "arguments"}}];
        # as in vLLM a missing type means "function", and arguments may already be an object.
        if v is None:
            return v
        if not isinstance(v, list):
            raise _error("must be a list of tool calls")
        for call in v:
            if not isinstance(call, dict):
                raise _error("tool calls must be objects")
            if not isinstance(call.get("id"), str):
                raise _error("each tool call needs a string `id`")
            function = _named_function(call, "tool call")
            if not isinstance(function.get("arguments"), str | dict | None):
                raise _error("a tool call's `arguments` must be a JSON string")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # vLLM's "string" content format

    def as_dict(self) -> dict[str, Any]:
        """The message for a chat template: what vLLM hands to `apply_chat_template`."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.role == "assistant":
            if self.tool_calls:  # an empty list is dropped: the template's plain assistant path
                d["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
            reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
            if reasoning is not None:
                d["reasoning"] = d["reasoning_content"] = reasoning
        elif self.role == "tool" and self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call with its arguments as an object, the form transformers documents for chat
    templates. As vLLM's `_postprocess_messages`: a missing or empty `arguments` is {}, and text
    that is not a JSON object becomes {} with a warning rather than an error, since it sits in
    the history and would fail every later turn of the conversation."""
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            log.warning("tool call %r: arguments are not valid JSON; using {}",
                        function.get("name"))
            arguments = {}
    if not isinstance(arguments, dict):
        if arguments not in (None, ""):
            log.warning("tool call %r: arguments are not a JSON object; using {}",
                        function.get("name"))
        arguments = {}
    function["arguments"] = arguments
    return {**call, "function": function}


class _SamplingRequest(_Request):
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
                raise _error(f"Found token_id `{token_id}` in logit_bias but token_id must be "
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
    def _refuse_unsupported_fields(self) -> _SamplingRequest:
        for name, rule in REFUSED_FIELDS.items():
            if rule.endpoints not in ("both", self._endpoint):
                continue
            value = _field_value(self, name)
            if value is not _MISSING and value not in rule.accepted:
                raise _error(rule.message.replace("{value}", _describe(value)),
                             name.split(".")[0])
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise _error("must be a string or a list of strings")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise _error("Stream options can only be defined when `stream=True`.", "stream_options")
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
        )


class CompletionRequest(_SamplingRequest):
    _endpoint: ClassVar[str] = "completions"

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # With logprobs, the prompt tokens' logprobs come first (vLLM's prompt_logprobs).
    echo: bool = False
    # vLLM V0's best_of: that many samples per prompt, the n most likely returned (see
    # openai_endpoints._best_of). Null means n.
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
            raise _error(f"best_of must be greater than or equal to n, got n={self.n} and "
                         f"best_of={best_of}.", "best_of")
        if best_of > self.n and self.stream:
            raise _error(f"best_of={best_of} cannot be streamed: only the best n={self.n} of "
                         "the samples are returned, which is known when all are finished. "
                         "Set best_of equal to n, or do not stream.", "best_of")
        if best_of > 1 and self.temperature is not None and self.temperature < 1e-5:
            raise _error(f"best_of must be 1 when using greedy sampling, got {best_of}.",
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
                raise _error("must not be empty")
            if all(isinstance(p, str) for p in v) or all(_is_int(t) for t in v):
                return v
            if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v):
                if any(not p for p in v):
                    raise _error("token lists must not be empty")
                return v
        raise _error("must be a string, a list of strings, a list of token ids "
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


# --- chat template fields ---------------------------------------------------------------------

# chat_template_kwargs names vLLM refuses (its resolve_chat_template_kwargs).
_UNEXPECTED_TEMPLATE_KWARGS = ("chat_template", "tokenize")
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but this server does not take chat "
                      "templates from requests (vLLM: --trust-request-chat-template is not set). "
                      "Refused request with untrusted chat template.")


class _ChatTemplateRequest(_Request):
    """vLLM's chat template fields, shared by /v1/chat/completions and /tokenize.

    `chat_template_kwargs` are extra template variables (e.g. Qwen3's `enable_thinking`); as in
    vLLM, the request's own fields win over the same names in it (`add_generation_prompt`,
    `continue_final_message`, and `tools` / `documents` when given), and names the template
    does not read are dropped (serve/chat_prompt.py).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_shape(cls, v: Any) -> Any:
        # vLLM's ChatCompletionToolsParam: {"type": "function", "function": {"name",
        # "description"?, "parameters"?}}. The tools reach the template as sent.
        if v is None:
            return v
        if isinstance(v, list) and not v:
            raise _error("`tools` must not be an empty array. Either provide at least one tool "
                         "or omit the field entirely.")
        if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
            raise _error("must be a list of tool objects")
        for tool in v:
            function = _named_function(tool, "tool")
            if not isinstance(function.get("description"), str | None):
                raise _error("a tool's function `description` must be a string")
            if not isinstance(function.get("parameters"), dict | None):
                raise _error("a tool's function `parameters` must be an object (a JSON schema)")
        return v

    @model_validator(mode="after")
    def _template_fields(self) -> _ChatTemplateRequest:
        kwargs = self.chat_template_kwargs or {}
        if self.chat_template is not None:
            raise _error(UNTRUSTED_TEMPLATE, "chat_template")
        if kwargs.get("chat_template") is not None:
            raise _error(UNTRUSTED_TEMPLATE, "chat_template_kwargs")
        unexpected = [k for k in _UNEXPECTED_TEMPLATE_KWARGS if k in kwargs]
        if unexpected:  # vLLM prints the set; sorted here, so the message is stable
            names = ", ".join(repr(k) for k in unexpected)
            raise _error(f"Found unexpected chat template kwargs from request: {{{names}}}",
                         "chat_template_kwargs")
        if "messages" in kwargs:
            raise _error("chat_template_kwargs cannot set `messages`: the conversation is the "
                         "request's `messages`.", "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise _error("Cannot set both `continue_final_message` and `add_generation_prompt` "
                         "to True.", "continue_final_message")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The template variables besides messages and add_generation_prompt."""
        kwargs = dict(self.chat_template_kwargs or {})
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        if self.tools is not None:
            kwargs["tools"] = self.tools
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return kwargs


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateRequest):
    _endpoint: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI; max_completion_tokens wins
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}; "auto" when
    # tools are given without it. Only "none" is served (REFUSED_FIELDS): the tools reach the
    # prompt and the reply is text. Every other choice needs a tool-call parser.
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's default for chat: the chat template already wrote the special tokens it wants.
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _tool_choice(cls, data: Any) -> Any:
        # vLLM's ChatCompletionRequest.check_tool_usage, with its messages.
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        if "tool_choice" not in data and isinstance(tools, list) and tools:
            return {**data, "tool_choice": "auto"}
        choice = data.get("tool_choice")
        if choice is None or choice == "none":
            return data
        if tools is None:
            raise _error("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise _error(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                         '"none", "auto" or "required" are supported.', "tool_choice")
        if isinstance(choice, dict):
            usage_hint = ('Correct usage: `{"type": "function", "function": {"name": '
                          '"my_function"}}`')
            function = choice.get("function")
            if not isinstance(function, dict):
                raise _error(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                             f"{usage_hint}", "tool_choice")
            if "name" not in function:
                raise _error(f"Expected field `name` in `function` in `tool_choice`! "
                             f"{usage_hint}", "tool_choice")
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise _error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                             f"{usage_hint}", "tool_choice")
            if isinstance(tools, list) and not any(
                    isinstance(t, dict) and isinstance(t.get("function"), dict)
                    and t["function"].get("name") == name for t in tools):
                raise _error("The tool specified in `tool_choice` does not match any of the "
                             "specified `tools`", "tool_choice")
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _error("when using `top_logprobs`, `logprobs` must be set to true.",
                         "top_logprobs")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as a chat template sees them (ChatMessage.as_dict)."""
        return [m.as_dict() for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """`default_max_tokens` None: what is left of the context (the Processor fills it in)."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class TokenizeRequest(_ChatTemplateRequest):
    """vLLM's /tokenize: a `prompt`, or chat `messages` with the chat template fields."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _error("Exactly one of `prompt` or `messages` must be given.")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages or []]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --- errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON: `{"error": {"message", "type", "param", "code"}}`.

    Text is made encodable first: a message may quote client input, and a lone surrogate in it
    would make the error response itself fail to encode (a 500 in place of the 4xx).
    """
    info = ErrorInfo(message=_encodable(message), type=err_type,
                     param=None if param is None else _encodable(param), code=code)
    return ErrorResponse(error=info).model_dump()


def _encodable(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


_LOC_SOURCES = {"body", "query", "path", "header", "cookie"}


def validation_error_message(
    exc: pydantic.ValidationError | RequestValidationError,
) -> tuple[str, str | None]:
    """One readable message for all errors, and the first offending top-level param.

    E.g. ("temperature: Input should be a valid number, ...", "temperature").
    """
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        # FastAPI prefixes where the value came from; the client thinks in field names.
        # A missing body keeps its "body" label: there is no field to name instead.
        if loc and loc[0] in _LOC_SOURCES and not (len(loc) == 1 and err.get("type") == "missing"):
            loc = loc[1:]
        msg = str(err.get("msg", "invalid value"))
        ctx = err.get("ctx") or {}
        if err.get("type") == "json_invalid" and ctx.get("error"):
            msg = f"{msg}: {ctx['error']}"
        field = loc[0] if loc and isinstance(loc[0], str) else ctx.get("param")
        if param is None and isinstance(field, str):
            param = field
        # Integer-only locs are JSON byte positions, not fields; leave them out of the label.
        label = ".".join(str(x) for x in loc) if loc and isinstance(loc[0], str) else ""
        text = f"{label}: {msg}" if label else msg
        if text not in parts:
            parts.append(text)
    return "; ".join(parts) or "Invalid request", param


# --- responses --------------------------------------------------------------------------------


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _now(created: int | None) -> int:
    # Chunks of one stream should pass the same `created`; default is now.
    return int(time.time()) if created is None else created


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's field: prompt tokens served from the prefix cache
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(id: str, model: str, choices: list[dict[str, Any]],
                        usage: dict[str, Any], created: int | None = None) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": _now(created), "model": model,
            "choices": choices, "usage": usage}


def completion_chunk(id: str, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict[str, Any] | None = None,
                     created: int | None = None) -> dict[str, Any]:
    # OpenAI streams completions with the same object name as the full response.
    return {"id": id, "object": "text_completion", "created": _now(created), "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_choice(index: int, content: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(id: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any],
                  created: int | None = None) -> dict[str, Any]:
    return {"id": id, "object": "chat.completion", "created": _now(created), "model": model,
            "choices": choices, "usage": usage}


def chat_delta(content: str, first: bool = False) -> dict[str, str]:
    """A chunk's delta; OpenAI clients expect the role only on a choice's first chunk."""
    return {"role": "assistant", "content": content} if first else {"content": content}


def chat_chunk(id: str, model: str, index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None,
               created: int | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion.chunk", "created": _now(created), "model": model,
            "choices": [choice]}


def usage_chunk(id: str, model: str, object: str, usage: dict[str, Any],
                created: int | None = None) -> dict[str, Any]:
    """The final stream event when stream_options.include_usage is set."""
    return {"id": id, "object": object, "created": _now(created), "model": model,
            "choices": [], "usage": usage}


# --- logprobs ---------------------------------------------------------------------------------


def _render(render: TokenRenderer, token_id: int) -> str:
    text = render(token_id)
    # vLLM's spelling for a token the tokenizer cannot name, so the field is never null.
    return f"token_id:{token_id}" if text is None else text


def _finite(logprob: float | None) -> float | None:
    # -9999.0 is vLLM's stand-in for -inf, which JSON cannot carry.
    return -9999.0 if logprob == float("-inf") else logprob


def completion_logprobs(positions: Sequence[TokenLogprobs], render: TokenRenderer,
                        text_offset: int = 0) -> dict[str, list[Any]]:
    """Legacy completions logprobs; `text_offset` is where this text starts in the output
    (len(prompt) for echo, or the text already streamed)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for pairs in positions:
        (tok_id, lp), *top = pairs
        tok = _render(render, tok_id)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_finite(lp))
        out["text_offset"].append(text_offset)
        text_offset += len(tok)
        if lp is None:  # e.g. the first echoed prompt token has no logprob
            out["top_logprobs"].append(None)
            continue
        # Keyed by token text; the sampled token is always present (also for logprobs=0), and
        # setdefault keeps the higher (earlier) logprob if two ids render the same.
        tops: dict[str, float | None] = {}
        for t, tlp in top:
            tops.setdefault(_render(render, t), _finite(tlp))
        tops.setdefault(tok, _finite(lp))
        out["top_logprobs"].append(tops)
    return out


def _chat_token(render: TokenRenderer, token_id: int, logprob: float | None) -> dict[str, Any]:
    tok = _render(render, token_id)
    lp = -9999.0 if logprob is None else _finite(logprob)  # chat's schema has no null logprob
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}


def chat_logprobs(positions: Sequence[TokenLogprobs],
                  render: TokenRenderer) -> dict[str, list[dict[str, Any]]]:
    """Chat logprobs: per token, its logprob and its top_logprobs (the requested top-k)."""
    content = []
    for pairs in positions:
        (tok_id, lp), *top = pairs
        entry = _chat_token(render, tok_id, lp)
        entry["top_logprobs"] = [_chat_token(render, t, tlp) for t, tlp in top]
        content.append(entry)
    return {"content": content}
