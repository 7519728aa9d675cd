"""One streamed request against an OpenAI-compatible endpoint, timed as `vllm bench serve` does.

Nothing here is chunkserve-specific: any server speaking /v1/completions or /v1/chat/completions
with SSE streaming and `stream_options.include_usage` can be measured.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from chunkserve.benchlib.metrics import RequestResult


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(*, chat: bool, model: str, prompt: str, output_len: int, ignore_eos: bool,
                  temperature: float | None, extra_body: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True,
                               "stream_options": {"include_usage": True}}
    if chat:
        payload["messages"] = [{"role": "user", "content": prompt}]
        # Both names: newer servers read max_completion_tokens, older ones only max_tokens.
        payload["max_completion_tokens"] = output_len
        payload["max_tokens"] = output_len
    else:
        payload["prompt"] = prompt
        payload["max_tokens"] = output_len
    if temperature is not None:
        payload["temperature"] = temperature
    if ignore_eos:
        payload["ignore_eos"] = True  # a vLLM extension: only sent when asked for
    if extra_body:
        payload.update(extra_body)
    return payload


def json_schema_body(*, chat: bool, schema: dict[str, Any]) -> dict[str, Any]:
    """The fields that constrain the output to `schema`: OpenAI's `response_format` on chat
    (named by the schema's title), vLLM's `structured_outputs` on /v1/completions, where
    OpenAI's API has no such field."""
    if chat:
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": schema.get("title", "output"), "schema": schema}}}
    return {"structured_outputs": {"json": schema}}


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning models stream thoughts before content; both are generated tokens.
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


@dataclass
class _Stream:
    """What one response's SSE events said so far, with when each text chunk came."""

    chat: bool
    start: float
    text_parts: list[str] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    first_ts: float | None = None
    last_text_ts: float | None = None
    last_choice_ts: float | None = None

    def on_event(self, event: dict[str, Any], now: float) -> None:
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")
        choices = event.get("choices")
        if not choices:
            return
        self.last_choice_ts = now
        text = _chunk_text(choices[0], self.chat)
        if not text:
            return  # e.g. the chat role chunk: no token yet
        if self.last_text_ts is None:
            self.first_ts = now
        else:
            self.itl.append(now - self.last_text_ts)
        self.last_text_ts = now
        self.text_parts.append(text)

    def finish(self, result: RequestResult, count_tokens: Callable[[str], int] | None) -> None:
        """The result of a stream that ended well: timings and the output's token count."""
        if self.first_ts is None:
            result.error = "Never received a valid chunk to calculate TTFT."
            return
        result.itl = self.itl
        result.generated_text = "".join(self.text_parts)
        result.ttft = self.first_ts - self.start
        result.latency = (self.last_choice_ts or self.first_ts) - self.start
        if self.usage_tokens is not None:
            result.output_len = int(self.usage_tokens)
        elif count_tokens is not None:
            result.output_len = count_tokens(result.generated_text)
        else:
            result.output_len = len(self.text_parts)
        result.success = True


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], *,
                       prompt_len: int, headers: dict[str, str] | None = None,
                       count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """Stream one request; failures come back as results with success=False, never raised.

    TTFT is the first chunk carrying text, ITL the gap before each later text chunk (a chunk
    may hold several tokens), latency runs to the last chunk with choices, and output tokens
    are usage.completion_tokens (else `count_tokens(text)`, else the number of text chunks).
    """
    result = RequestResult(success=False, prompt_len=prompt_len, output_len=0, ttft=0.0)
    stream = _Stream("messages" in payload, time.perf_counter())
    result.start_time = stream.start
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = await response.text()
                result.error = f"HTTP {response.status}: {body[:1000]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments, event:/id: fields
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:1000]}"
                    return result
                stream.on_event(event, now)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    stream.finish(result, count_tokens)
    return result
