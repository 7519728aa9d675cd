"""The prompt of a chat request: its messages and template fields through the model's chat
template, as vLLM renders them.

What reaches the template, as in vLLM (renderers/hf.py, `resolve_chat_template_kwargs` and
`safe_apply_chat_template`): the messages, `add_generation_prompt`, `tools` and `documents`,
and of `chat_template_kwargs` only the names the template reads (other names are dropped, so
an unused kwarg is harmless). `continue_final_message` leaves the last message open, the way
transformers 5.x does it: a tag after its text, rendered, then cut off.
"""
from __future__ import annotations

from typing import Any

from chunkserve.tokenizer.chat_template import template_variables
from chunkserve.tokenizer.tokenizer import Tokenizer

# transformers' marker (render_jinja_template): appended to the final message, cut after
# rendering. Its trailing space shows whether the template kept the message's spacing.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Variables given to every template whether or not it reads them (transformers always defines
# tools and documents).
_ALWAYS_PASSED = frozenset({"tools", "documents"})


def _read_by(template: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = template_variables(template)
    if names is None:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in names or k in _ALWAYS_PASSED}


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text. Raises ValueError (no template, a final message the template drops),
    jinja2.TemplateError (the template refuses the conversation) or whatever the template's
    own expressions raise on odd values."""
    template = tokenizer.chat_template
    if template is None:
        raise ValueError("this model has no chat template; send a plain completion prompt "
                         "instead.")
    kwargs = _read_by(template, dict(template_kwargs or {}))
    if not continue_final_message:
        return tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)

    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = messages[-1].get("content")
    if not isinstance(final, str):
        raise ValueError('continue_final_message is set but the final message has no "content" '
                         "to continue!")
    if "content" not in template:
        raise ValueError('continue_final_message is set to "content" but this is not an '
                         "accepted field in the chat_template")
    tagged = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
    text = tokenizer.apply_chat_template(tagged, add_generation_prompt, **kwargs)
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear "
                         "in the chat after applying the chat template: the template drops "
                         "part of it.")
    at = text.rindex(CONTINUE_TAG.strip())
    if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]  # the template kept the message's spacing
    return text[:at].rstrip()  # it trimmed trailing space, the tag's included
