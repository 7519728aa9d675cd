"""Renders a model's Jinja chat template the way transformers does, so prompts match byte for byte.

Mirrors transformers' `chat_template_utils` (5.x): the environment of `_compile_jinja_template`
and what `render_jinja_template` does to its inputs. tests/test_chat_templates.py compares the two
on real templates (Qwen2.5, Qwen3, Phi-3, Mistral).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Older jinja2 releases have known sandbox escapes, and templates come from model files.
_MIN_JINJA2 = (3, 1, 6)


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would corrupt tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict` for templates without the class itself, so no attribute of it leads anywhere.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Jinja's namespace, refusing underscore-prefixed attributes (a way towards CPython internals).
    # No `self` parameter, as in Jinja's Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}."
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with it
    for training masks (its AssistantTracker); rendering a prompt keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); found "
                          f"{jinja2.__version__}.")
    # Templates come from model files, i.e. untrusted: sandboxed, and immutable so a template
    # cannot mutate the messages we pass in. trim/lstrip_blocks are what HF templates are written for.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a template reads without setting them (what a request's
    chat_template_kwargs may usefully set); None when it does not parse (rendering then
    reports the error)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return None


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (transformers' `_plain_template_data`): the sandbox
    does not know which methods of other objects are dangerous, so templates never see any."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) can carry methods: back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# Names a message's reasoning comes under; templates read the first (Qwen3 does), gpt-oss reads
# `thinking`, and vLLM's API answers with `reasoning`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(messages: list[Any]) -> list[Any]:
    aliased = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                             None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         **variables: Any) -> str:
    """The prompt text for `messages`; `variables` are bos_token, eos_token, tools, documents and
    whatever else the template reads (enable_thinking, ...). As transformers'
    `render_jinja_template`: `tools` and `documents` are always defined (None when not given),
    everything is passed as plain data, and reasoning under another name is also given as
    `reasoning_content`."""
    tools = variables.pop("tools", None)
    documents = variables.pop("documents", None)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}.")
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _plain(list(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    return _compile(template).render(
        messages=_alias_reasoning_fields(chat), tools=_plain(tools), documents=_plain(documents),
        add_generation_prompt=add_generation_prompt, **_plain(variables),
    )
