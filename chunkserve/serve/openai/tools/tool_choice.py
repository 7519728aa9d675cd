"""Tool calls in chat completions: what each `tool_choice` constrains, and how a choice's text
becomes OpenAI's `tool_calls`, whole or streamed as deltas.

As vLLM serves them:
- "none": the tools reach the prompt, the reply is text.
- "auto": the model may call tools; the server's `--tool-call-parser` reads them out of its
  text (needs `--enable-auto-tool-choice`). Nothing is constrained.
- "required": a grammar makes the output a JSON array of {"name", "parameters"} for the given
  tools (at least one call), so the calls always parse.
- a named function: a grammar makes the output that function's arguments.
`finish_reason` is "tool_calls" when "auto" found calls or "required" stopped, and stays "stop"
for a named function: OpenAI's rule, kept by vLLM.
"""
from __future__ import annotations

import uuid
from typing import Any

from chunkserve.sampling_params import StructuredOutputsParams
from chunkserve.serve.openai.tools.parsers import (
    TOOL_CALL_PARSERS,
    Extracted,
    NamedFunctionParser,
    RequiredParser,
    ToolCallParser,
)

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     "--tool-call-parser to be set")
_NO_ARGUMENTS = {"type": "object", "properties": {}}


def named_choice(tool_choice: Any) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name"}}), if any."""
    if isinstance(tool_choice, dict):
        return str(tool_choice["function"]["name"])
    return None


def tool_choice_constraint(tools: list[dict[str, Any]] | None, tool_choice: Any,
                           parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The grammar a tool_choice puts on the output: none for "none" and "auto"."""
    if not tools:
        return None
    parameters = {t["function"]["name"]: t["function"].get("parameters") or _NO_ARGUMENTS
                  for t in tools}
    # A tool's `strict: true` (OpenAI's field) makes every keyword of its schema binding.
    strict = {t["function"]["name"]: t["function"].get("strict") is True for t in tools}
    name = named_choice(tool_choice)
    if name is not None:
        return StructuredOutputsParams(json=parameters[name], strict=strict[name])
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    calls = []
    for fn, schema in parameters.items():
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [fn]},
                                     "parameters": _lift_defs(fn, schema, defs)},
                      "required": ["name", "parameters"], "additionalProperties": False})
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json={**array, "$defs": defs} if defs else array,
                                   strict=all(strict.values()))


def _lift_defs(function: str, schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`schema` without its `$defs`, which join `defs`: a "#/$defs/..." reference means the
    root of the schema, which for "required" is the array around every tool (vLLM's rule)."""
    if "$defs" not in schema:
        return schema
    for key, value in schema["$defs"].items():
        if defs.get(key, value) != value:
            raise ValueError(f"Tool definition '{key}' has multiple schemas, which is not "
                             f"supported (function {function!r}).")
        defs[key] = value
    return {k: v for k, v in schema.items() if k != "$defs"}


def tool_call_parser(tool_choice: Any, tools: list[dict[str, Any]] | None,
                     auto_parser: str | None) -> ToolCallParser | None:
    """What reads a choice's tool calls; None when the reply is plain text. `auto_parser`: the
    server's --tool-call-parser, when --enable-auto-tool-choice is set; "auto" without one is
    the caller's 400 (AUTO_NEEDS_PARSER)."""
    if not tools or tool_choice in (None, "none"):
        return None
    name = named_choice(tool_choice)
    if name is not None:
        return NamedFunctionParser(name)
    if tool_choice == "required":
        return RequiredParser()
    if auto_parser is None:
        raise ValueError(AUTO_NEEDS_PARSER)
    return TOOL_CALL_PARSERS[auto_parser]()


class ToolCallReader:
    """One choice's tool calls: the whole message at the end, or the deltas as text streams."""

    def __init__(self, parser: ToolCallParser, parallel_tool_calls: bool = True) -> None:
        self.parser = parser
        # parallel_tool_calls false: the first call only (an "auto" model may write more).
        self.max_calls = None if parallel_tool_calls else 1
        self.text = ""
        self.ids: list[str] = []  # one per call sent so far
        self.sent_content = 0
        self.sent_arguments: list[int] = []

    def finish_reason(self, extracted: Extracted, reason: str | None) -> str | None:
        if not extracted.calls or isinstance(self.parser, NamedFunctionParser):
            return reason
        if isinstance(self.parser, RequiredParser) and reason != "stop":
            return reason  # cut off (max_tokens): the array is not whole
        return "tool_calls"

    def message(self, text: str, reason: str | None
                ) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """The whole reply's content, tool calls and finish_reason."""
        extracted = self._extract(text, final=True)
        calls = [{"id": _call_id(), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}}
                 for c in extracted.calls]
        return extracted.content, calls, self.finish_reason(extracted, reason)

    def delta(self, new_text: str, final: bool,
              reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for `new_text` (what the stream released since the last call): new content
        and new or longer calls. `final`: the choice has finished with `reason`."""
        self.text += new_text
        extracted = self._extract(self.text, final)
        delta: dict[str, Any] = {}
        content = (extracted.content or "")[self.sent_content:]
        if content:
            delta["content"] = content
            self.sent_content += len(content)
        calls = [d for d in (self._call_delta(i, c) for i, c in enumerate(extracted.calls)) if d]
        if calls:
            delta["tool_calls"] = calls
        return delta, self.finish_reason(extracted, reason) if final else None

    def _extract(self, text: str, final: bool) -> Extracted:
        extracted = self.parser.extract(text, final)
        extracted.calls = extracted.calls[:self.max_calls]
        return extracted

    def _call_delta(self, index: int, call: Any) -> dict[str, Any] | None:
        if call.name is None or index > len(self.ids):
            return None  # sent once its name is known, with the arguments so far
        if index == len(self.ids):
            self.ids.append(_call_id())
            self.sent_arguments.append(len(call.arguments))
            return {"index": index, "id": self.ids[index], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
        more = call.arguments[self.sent_arguments[index]:]
        if not more:
            return None
        self.sent_arguments[index] = len(call.arguments)
        return {"index": index, "function": {"arguments": more}}


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
