"""Reading a JSON object while the model is still writing it: which members are there yet, and
where each value's text lies.

Tool calls stream as deltas of their `arguments` text (serve/openai/tools/tool_choice.py). That text must be
the same slice of the output whether it is read token by token or once at the end, so the
scanner reports spans of the text, never re-serialized values: a value still being written is
the rest of the text from its start, and every later read only extends it. Complete values are
json's own `raw_decode`; only the object's punctuation is walked here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass
class Member:
    start: int  # where the value's text starts in the scanned text
    end: int  # where it ends (the end of the text while it is incomplete)
    complete: bool
    value: object = None  # the decoded value, once complete


@dataclass
class ObjectScan:
    members: dict[str, Member] = field(default_factory=dict)
    complete: bool = False  # the closing brace has been read
    end: int = 0  # just past the closing brace, once complete
    valid: bool = True  # False: the text cannot become a JSON object

    def text(self, source: str, key: str) -> str:
        m = self.members[key]
        return source[m.start:m.end]


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def scan_object(text: str, i: int) -> ObjectScan:
    """Scans the object that starts at text[i] (whitespace first is skipped) as far as the text
    goes. A value that ends exactly at the end of the text counts as incomplete: a number
    there ("12") may still grow ("123")."""
    scan = ObjectScan()
    i = skip_whitespace(text, i)
    if i < len(text) and text[i] != "{":
        scan.valid = False
    if i >= len(text) or not scan.valid:
        return scan
    i += 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.complete, scan.end = True, i + 1
            return scan
        if text[i] == "," and scan.members:
            i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return scan
        if text[i] != '"':
            scan.valid = False
            return scan
        key, i = _read_key(text, i)
        if key is None:
            return scan  # the key is still being written
        i = skip_whitespace(text, i)
        if i < len(text) and text[i] != ":":
            scan.valid = False
            return scan
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return scan
        member = _read_value(text, i)
        scan.members[key] = member
        if not member.complete:
            return scan
        i = member.end


def _read_key(text: str, i: int) -> tuple[str | None, int]:
    try:
        key, end = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
    except ValueError:
        return None, i
    return key, end


def _read_value(text: str, i: int) -> Member:
    try:
        value, end = _DECODER.raw_decode(text, i)
    except ValueError:  # still being written (or malformed: the final read decides)
        return Member(i, len(text), False)
    if end == len(text) and not isinstance(value, dict | list | str):
        return Member(i, end, False)  # a number or literal at the very end may still grow
    return Member(i, end, True, value)
