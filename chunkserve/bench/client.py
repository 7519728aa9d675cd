"""One streamed request against an OpenAI-compatible endpoint, timed as `vllm bench serve` does.

Nothing here is chunkserve-specific: any server speaking /v1/completions or /v1/chat/completions
with SSE streaming and `stream_options.include_usage` can be measured.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
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


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], *,
                       prompt_len: int, headers: dict[str, str] | None = None,
                       count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """Stream one request; failures come back as results with success=False, never raised.

    TTFT is the first chunk carrying text, ITL the gap before each later text chunk (a chunk
    may hold several tokens), latency runs to the last chunk with choices, and output tokens
    are usage.completion_tokens (else `count_tokens(text)`, else the number of text chunks).
    """
    chat = "messages" in payload
    result = RequestResult(success=False, prompt_len=prompt_len, output_len=0, ttft=0.0)
    text_parts: list[str] = []
    usage_tokens: int | None = None
    first_ts = last_text_ts = last_choice_ts = None
    start = time.perf_counter()
    result.start_time = start
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
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices")
                if not choices:
                    continue
                last_choice_ts = now
                text = _chunk_text(choices[0], chat)
                if not text:
                    continue  # e.g. the chat role chunk: no token yet
                if first_ts is None:
                    first_ts = now
                else:
                    result.itl.append(now - last_text_ts)  # type: ignore[operator]
                last_text_ts = now
                text_parts.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if first_ts is None:
        result.error = "Never received a valid chunk to calculate TTFT."
        return result
    result.generated_text = "".join(text_parts)
    result.ttft = first_ts - start
    result.latency = (last_choice_ts or first_ts) - start
    if usage_tokens is not None:
        result.output_len = int(usage_tokens)
    elif count_tokens is not None:
        result.output_len = count_tokens(result.generated_text)
    else:
        result.output_len = len(text_parts)
    result.success = True
    return result
