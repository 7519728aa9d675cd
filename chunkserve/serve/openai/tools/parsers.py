"""Tool calls read out of a model's text: the parsers `--tool-call-parser` names, and the two
fixed formats a grammar forces for tool_choice "required" and a named function.

Every parser reads the whole text so far (`extract(text, final)`) and answers with the content
and the calls in it. Read again with more text, its answer only grows: content never takes back
a character (a tail that may still become a tool-call tag is held back until it is decided),
and a call's arguments are a span of the text that only extends (serve/openai/tools/json_scan.py). Streamed
deltas are the differences between successive answers (serve/openai/tools/tool_choice.py), so a stream adds
up to exactly the whole response's calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from chunkserve.serve.openai.tools.json_scan import ObjectScan, scan_object, skip_whitespace


@dataclass
class CallText:
    name: str | None  # None while the name is still being written
    arguments: str  # the arguments' JSON text so far, as the model wrote it
    complete: bool = False


@dataclass
class Extracted:
    content: str | None  # the text that is not a tool call; None when there is none
    calls: list[CallText] = field(default_factory=list)


class ToolCallParser(Protocol):
    def extract(self, text: str, final: bool) -> Extracted:
        """The content and calls of `text`; `final`: no more text will come."""
        ...


def _call(text: str, scan: ObjectScan, argument_keys: tuple[str, ...]) -> CallText:
    """The call in a scanned {"name": ..., <argument key>: {...}} object."""
    name = scan.members.get("name")
    arguments = ""
    for key in argument_keys:
        if key in scan.members:
            arguments = scan.text(text, key)
            break
    named = name is not None and name.complete and isinstance(name.value, str)
    return CallText(name.value if named else None, arguments,  # type: ignore[arg-type]
                    scan.complete)


def _well_formed(calls: list[CallText]) -> bool:
    """At the end: every call is a finished object with a name (arguments may be left out)."""
    return bool(calls) and all(c.complete and c.name is not None for c in calls)


def _finish(calls: list[CallText]) -> list[CallText]:
    # A call written without arguments takes none, as an empty object.
    return [c if c.arguments else CallText(c.name, "{}", True) for c in calls]


def _held_back(text: str, tag: str) -> str:
    """`text` less a tail that could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


class HermesParser:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after
    optional text, which is the content (vLLM's hermes parser)."""

    START = "<tool_call>"

    def extract(self, text: str, final: bool) -> Extracted:
        at = text.find(self.START)
        if at < 0:
            return Extracted(text if final else _held_back(text, self.START))
        calls = []
        while at >= 0:
            scan = scan_object(text, at + len(self.START))
            if not scan.valid:
                break
            calls.append(_call(text, scan, ("arguments",)))
            if not scan.complete:
                break
            at = text.find(self.START, scan.end)
        if final and not _well_formed(calls):
            return Extracted(text)  # not tool calls after all: all of it is content, as vLLM
        return Extracted(text[:text.find(self.START)] or None,
                         _finish(calls) if final else calls)


class Llama3JsonParser:
    """Llama 3.1+ JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`,
    several joined by `;`, maybe after `<|python_tag|>` (vLLM's llama3_json parser); output
    that does not start with `{` is content."""

    PYTHON_TAG = "<|python_tag|>"

    def extract(self, text: str, final: bool) -> Extracted:
        start = text.find(self.PYTHON_TAG)
        i = skip_whitespace(text, start + len(self.PYTHON_TAG) if start >= 0 else 0)
        if i >= len(text) or (not final and start < 0 and self.PYTHON_TAG.startswith(text[i:])):
            return Extracted(text if final else None)  # nothing decides it yet
        if text[i] != "{":
            return Extracted(text)
        calls = []
        while True:
            scan = scan_object(text, i)
            if not scan.valid:
                break
            calls.append(_call(text, scan, ("parameters", "arguments")))
            i = skip_whitespace(text, scan.end)
            if not scan.complete or i >= len(text) or text[i] != ";":
                break
            i += 1
        if final and not _well_formed(calls):
            return Extracted(text)
        return Extracted(None, _finish(calls) if final else calls)


class NamedFunctionParser:
    """tool_choice naming a function: the grammar makes the whole output its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def extract(self, text: str, final: bool) -> Extracted:
        return Extracted(None, [CallText(self.name, text, final)])


class RequiredParser:
    """tool_choice "required": the grammar makes the output a JSON array of
    {"name": ..., "parameters": {...}} (serve/openai/tools/tool_choice.py's schema, vLLM's shape)."""

    def extract(self, text: str, final: bool) -> Extracted:
        i = skip_whitespace(text, 0)
        calls: list[CallText] = []
        if i >= len(text) or text[i] != "[":
            return Extracted(text if final else None)
        i += 1
        while True:
            i = skip_whitespace(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
            if i >= len(text) or text[i] == "]":
                break
            scan = scan_object(text, i)
            if not scan.valid:
                break
            calls.append(_call(text, scan, ("parameters",)))
            if not scan.complete:
                break
            i = scan.end
        if final and not _well_formed(calls):
            return Extracted(text)
        return Extracted(None, _finish(calls) if final else calls)


# The parsers `--tool-call-parser` can name.
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
