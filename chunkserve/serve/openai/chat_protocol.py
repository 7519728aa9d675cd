"""Chat request models: a conversation's messages, vLLM's chat template fields, and the requests
that carry them (/v1/chat/completions, and /tokenize, which takes chat messages too).

The tools, tool_choice and past tool calls are checked in serve/openai/tools/validation.py; the template is
rendered in serve/openai/chat_prompt.py.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chunkserve.sampling_params import SamplingParams, StructuredOutputsParams
from chunkserve.serve.openai.tools.validation import (
    check_tool_calls,
    check_tool_choice,
    check_tools,
    template_tool_call,
)
from chunkserve.serve.http.errors import field_error
from chunkserve.serve.openai.protocol import MAX_LOGPROBS, BaseRequest, SamplingRequest
from chunkserve.serve.openai.tools.tool_choice import tool_choice_constraint


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
            raise field_error("must be a string or a list of content parts")
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise field_error("only text content is supported")
            if not isinstance(part.get("text"), str):
                raise field_error("text content parts need a string `text`")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls_shape(cls, v: Any) -> Any:
        return check_tool_calls(v)

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
                d["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
            reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
            if reasoning is not None:
                d["reasoning"] = d["reasoning_content"] = reasoning
        elif self.role == "tool" and self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


# chat_template_kwargs names vLLM refuses (its resolve_chat_template_kwargs).
_UNEXPECTED_TEMPLATE_KWARGS = ("chat_template", "tokenize")
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but this server does not take chat "
                      "templates from requests (vLLM: --trust-request-chat-template is not set). "
                      "Refused request with untrusted chat template.")


class _ChatTemplateRequest(BaseRequest):
    """vLLM's chat template fields, shared by /v1/chat/completions and /tokenize.

    `chat_template_kwargs` are extra template variables (e.g. Qwen3's `enable_thinking`); as in
    vLLM, the request's own fields win over the same names in it (`add_generation_prompt`,
    `continue_final_message`, and `tools` / `documents` when given), and names the template
    does not read are dropped (serve/openai/chat_prompt.py).
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
        return check_tools(v)

    @model_validator(mode="after")
    def _template_fields(self) -> _ChatTemplateRequest:
        kwargs = self.chat_template_kwargs or {}
        if self.chat_template is not None:
            raise field_error(UNTRUSTED_TEMPLATE, "chat_template")
        if kwargs.get("chat_template") is not None:
            raise field_error(UNTRUSTED_TEMPLATE, "chat_template_kwargs")
        unexpected = [k for k in _UNEXPECTED_TEMPLATE_KWARGS if k in kwargs]
        if unexpected:  # vLLM prints the set; sorted here, so the message is stable
            names = ", ".join(repr(k) for k in unexpected)
            raise field_error(
                f"Found unexpected chat template kwargs from request: {{{names}}}",
                "chat_template_kwargs")
        if "messages" in kwargs:
            raise field_error("chat_template_kwargs cannot set `messages`: the conversation is "
                              "the request's `messages`.", "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.", "continue_final_message")
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


class ChatCompletionRequest(SamplingRequest, _ChatTemplateRequest):
    _endpoint: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI; max_completion_tokens wins
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}; "auto" when
    # tools are given without it (serve/openai/tools/tool_choice.py says what each one does).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: at most one tool call
    # vLLM's default for chat: the chat template already wrote the special tokens it wants.
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _tool_choice(cls, data: Any) -> Any:
        return check_tool_choice(data)

    def _structured_constraint(self) -> StructuredOutputsParams | None:
        """A structured-output field, or the grammar of tool_choice "required" or a named
        function; not both, since the output cannot match two."""
        sent = super()._structured_constraint()
        try:
            tools = tool_choice_constraint(self.tools, self.tool_choice,
                                           self.parallel_tool_calls)
        except ValueError as e:
            raise field_error(str(e), "tools") from None
        if tools is not None and sent is not None:
            raise field_error("tool_choice \"required\" or a named function constrains the "
                              "output to tool calls; it cannot be combined with "
                              "response_format, guided_* or structured_outputs.", "tool_choice")
        return sent or tools

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("when using `top_logprobs`, `logprobs` must be set to true.",
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
            raise field_error("Exactly one of `prompt` or `messages` must be given.")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages or []]

