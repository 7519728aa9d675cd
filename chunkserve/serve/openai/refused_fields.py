"""The request fields this server refuses, and those it accepts knowing they change nothing.

Requests accept unknown fields (vLLM logs a warning rather than rejecting them, and clients such
as the `openai` package send extras). No field that would change the output is ignored, though:
those this server does not implement are listed in `REFUSED_FIELDS` and are a 400 naming the
field unless sent with their default value (`check_refused_fields`, run by every sampling
request).
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple

from pydantic import BaseModel

from chunkserve.serve.http.errors import field_error


class Refused(NamedTuple):
    """A request field that would change the output and that this server does not implement."""

    endpoints: str  # "completions", "chat" or "both"
    accepted: tuple[Any, ...]  # values that change nothing (the default): accepted silently
    message: str  # the 400's message; "{value}" is replaced by the value sent


# Every OpenAI or vLLM request field that would change the output and is not implemented here:
# sent with any value but an accepted one (its default), it is a 400 whose `param` is the field
# (the part before the dot for a nested one), never a warning. The one place this rule lives;
# fields that change nothing (HARMLESS_FIELDS) and unknown ones are accepted, the unknown ones
# with a warning, as vLLM does.
REFUSED_FIELDS: dict[str, Refused] = {
    # OpenAI's fields.
    "suffix": Refused("completions", (None,), "suffix is not currently supported"),
    "functions": Refused("chat", (None,), "`functions` (deprecated by OpenAI) is not supported: "
                         'send `tools` with tool_choice "none"'),
    "function_call": Refused("chat", (None, "none"), "function_call={value} is not supported: "
                             "`function_call` is deprecated by OpenAI; send `tools` and "
                             "`tool_choice`"),
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
# refused field): accepted without a warning.
HARMLESS_FIELDS = frozenset({
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "prediction",
    "request_id", "cache_salt",
})
_MISSING = object()


def known_extra_field(name: str, endpoint: str | None) -> bool:
    """Whether an extra (undeclared) field sent to `endpoint` is one this server knows: one of
    HARMLESS_FIELDS, or of REFUSED_FIELDS for that endpoint (refused unless its default)."""
    return name in HARMLESS_FIELDS or (
        name in REFUSED_FIELDS and REFUSED_FIELDS[name].endpoints in ("both", endpoint))


def check_refused_fields(request: BaseModel, endpoint: str) -> None:
    """Raise a 400 for the first field of REFUSED_FIELDS that `request` sent to `endpoint` with
    a value other than an accepted one; its param is the field (before the dot, if nested)."""
    for name, rule in REFUSED_FIELDS.items():
        if rule.endpoints not in ("both", endpoint):
            continue
        value = _field_value(request, name)
        if value is not _MISSING and value not in rule.accepted:
            raise field_error(rule.message.replace("{value}", _describe(value)),
                              name.split(".")[0])


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
