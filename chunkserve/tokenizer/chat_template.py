"""Renders a model's Jinja chat template the way transformers does, so prompts match byte for byte."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Templates come from model files, i.e. untrusted: sandboxed, and immutable so a template
    # cannot mutate the messages we pass in. trim/lstrip_blocks are what HF templates are written for.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         **variables: Any) -> str:
    """The prompt text for `messages`; `variables` are bos_token, eos_token, tools, etc."""
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )
