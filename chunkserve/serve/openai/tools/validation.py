"""Tools in a chat request: the `tools` list, `tool_choice`, and tool calls in the history.

The checks follow vLLM's (its ChatCompletionToolsParam, check_tool_usage and chat_utils), with
its messages. The tools reach the chat template as sent; a past tool call reaches it with its
arguments decoded into an object (`template_tool_call`). What each tool_choice does to the
output is serve/openai/tools/tool_choice.py's.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from chunkserve.serve.http.errors import field_error

log = logging.getLogger("chunkserve.server")

_TOOL_CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def named_function(item: dict[str, Any], what: str) -> dict[str, Any]:
    """The `function` object of a tool or tool call, which must be of type "function" and name
    its function."""
    function = item.get("function")
    if item.get("type", "function") != "function" or not isinstance(function, dict):
        raise field_error(f'only {what}s of type "function", with a `function` object, are '
                          "supported")
    if not isinstance(function.get("name"), str):
        raise field_error(f"a {what}'s function needs a string `name`")
    return function


def check_tools(v: Any) -> Any:
    """`tools`: null, or a non-empty list of {"type": "function", "function": {"name",
    "description"?, "parameters"?}}."""
    if v is None:
        return v
    if isinstance(v, list) and not v:
        raise field_error("`tools` must not be an empty array. Either provide at least one tool "
                          "or omit the field entirely.")
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise field_error("must be a list of tool objects")
    for tool in v:
        function = named_function(tool, "tool")
        if not isinstance(function.get("description"), str | None):
            raise field_error("a tool's function `description` must be a string")
        if not isinstance(function.get("parameters"), dict | None):
            raise field_error("a tool's function `parameters` must be an object (a JSON schema)")
        if not isinstance(function.get("strict"), bool | None):
            raise field_error("a tool's function `strict` must be a boolean")
    return v


def check_tool_choice(data: Any) -> Any:
    """A chat request's raw body, with tool_choice "auto" filled in when tools come without one
    (OpenAI's default); a tool_choice that names no valid choice is a 400."""
    if not isinstance(data, dict):
        return data
    tools = data.get("tools")
    if "tool_choice" not in data and isinstance(tools, list) and tools:
        return {**data, "tool_choice": "auto"}
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return data
    if tools is None:
        raise field_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise field_error(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                          '"none", "auto" or "required" are supported.', "tool_choice")
    if isinstance(choice, dict):
        _check_named_choice(choice, tools)
    return data


def _check_named_choice(choice: dict[str, Any], tools: Any) -> None:
    """tool_choice {"type": "function", "function": {"name"}}, naming one of `tools`."""
    function = choice.get("function")
    if not isinstance(function, dict):
        raise field_error(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                          f"{_TOOL_CHOICE_USAGE}", "tool_choice")
    if "name" not in function:
        raise field_error(f"Expected field `name` in `function` in `tool_choice`! "
                          f"{_TOOL_CHOICE_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise field_error(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                          f"{_TOOL_CHOICE_USAGE}", "tool_choice")
    if isinstance(tools, list) and not any(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and t["function"].get("name") == name for t in tools):
        raise field_error("The tool specified in `tool_choice` does not match any of the "
                          "specified `tools`", "tool_choice")


def check_tool_calls(v: Any) -> Any:
    """An assistant message's `tool_calls`: null, or OpenAI's [{"id", "type": "function",
    "function": {"name", "arguments"}}]; as in vLLM a missing type means "function", and
    arguments may already be an object."""
    if v is None:
        return v
    if not isinstance(v, list):
        raise field_error("must be a list of tool calls")
    for call in v:
        if not isinstance(call, dict):
            raise field_error("tool calls must be objects")
        if not isinstance(call.get("id"), str):
            raise field_error("each tool call needs a string `id`")
        function = named_function(call, "tool call")
        if not isinstance(function.get("arguments"), str | dict | None):
            raise field_error("a tool call's `arguments` must be a JSON string")
    return v


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
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
