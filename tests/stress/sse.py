"""Reading SSE events in the stress phases."""
from __future__ import annotations

import json


def is_error_event(line: str) -> bool:
    """An OpenAI-style `{"error": ...}` event (the line as read, `data:` included)."""
    # Parsed, not searched: a generated token whose text is "error" reads `"text": "error"`.
    payload = line.removeprefix("data:").strip()
    if payload == "[DONE]":
        return False
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return False
    return isinstance(event, dict) and "error" in event
