"""OpenAI's response bodies for completions and chat completions, whole and streamed, and their
logprobs.

Responses are plain dicts built by small helpers, so the server can stream them with
`json.dumps` and tests can compare their keys to OpenAI's exactly. (serve/http/sse.py holds the
HTTP response classes that send them.)
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

# Engine logprobs for one generated position: [(sampled id, logprob), *top-k (id, logprob)].
TokenLogprobs = Sequence[tuple[int, float | None]]
# Renders one token id as text (e.g. `lambda t: tokenizer.decode([t])`).
TokenRenderer = Callable[[int], str | None]


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _now(created: int | None) -> int:
    # Chunks of one stream should pass the same `created`; default is now.
    return int(time.time()) if created is None else created


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's field: prompt tokens served from the prefix cache
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(id: str, model: str, choices: list[dict[str, Any]],
                        usage: dict[str, Any], created: int | None = None) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": _now(created), "model": model,
            "choices": choices, "usage": usage}


def completion_chunk(id: str, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict[str, Any] | None = None,
                     created: int | None = None) -> dict[str, Any]:
    # OpenAI streams completions with the same object name as the full response.
    return {"id": id, "object": "text_completion", "created": _now(created), "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_choice(index: int, content: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_response(id: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any],
                  created: int | None = None) -> dict[str, Any]:
    return {"id": id, "object": "chat.completion", "created": _now(created), "model": model,
            "choices": choices, "usage": usage}


def chat_delta(content: str, first: bool = False) -> dict[str, str]:
    """A chunk's delta; OpenAI clients expect the role only on a choice's first chunk."""
    return {"role": "assistant", "content": content} if first else {"content": content}


def chat_chunk(id: str, model: str, index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None,
               created: int | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion.chunk", "created": _now(created), "model": model,
            "choices": [choice]}


def usage_chunk(id: str, model: str, object: str, usage: dict[str, Any],
                created: int | None = None) -> dict[str, Any]:
    """The final stream event when stream_options.include_usage is set."""
    return {"id": id, "object": object, "created": _now(created), "model": model,
            "choices": [], "usage": usage}


# --- logprobs ---------------------------------------------------------------------------------


def _render(render: TokenRenderer, token_id: int) -> str:
    text = render(token_id)
    # vLLM's spelling for a token the tokenizer cannot name, so the field is never null.
    return f"token_id:{token_id}" if text is None else text


def _finite(logprob: float | None) -> float | None:
    # -9999.0 is vLLM's stand-in for -inf, which JSON cannot carry.
    return -9999.0 if logprob == float("-inf") else logprob


def completion_logprobs(positions: Sequence[TokenLogprobs], render: TokenRenderer,
                        text_offset: int = 0) -> dict[str, list[Any]]:
    """Legacy completions logprobs; `text_offset` is where this text starts in the output
    (len(prompt) for echo, or the text already streamed)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for pairs in positions:
        (tok_id, lp), *top = pairs
        tok = _render(render, tok_id)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_finite(lp))
        out["text_offset"].append(text_offset)
        text_offset += len(tok)
        if lp is None:  # e.g. the first echoed prompt token has no logprob
            out["top_logprobs"].append(None)
            continue
        # Keyed by token text; the sampled token is always present (also for logprobs=0), and
        # setdefault keeps the higher (earlier) logprob if two ids render the same.
        tops: dict[str, float | None] = {}
        for t, tlp in top:
            tops.setdefault(_render(render, t), _finite(tlp))
        tops.setdefault(tok, _finite(lp))
        out["top_logprobs"].append(tops)
    return out


def _chat_token(render: TokenRenderer, token_id: int, logprob: float | None) -> dict[str, Any]:
    tok = _render(render, token_id)
    lp = -9999.0 if logprob is None else _finite(logprob)  # chat's schema has no null logprob
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}


def chat_logprobs(positions: Sequence[TokenLogprobs],
                  render: TokenRenderer) -> dict[str, list[dict[str, Any]]]:
    """Chat logprobs: per token, its logprob and its top_logprobs (the requested top-k)."""
    content = []
    for pairs in positions:
        (tok_id, lp), *top = pairs
        entry = _chat_token(render, tok_id, lp)
        entry["top_logprobs"] = [_chat_token(render, t, tlp) for t, tlp in top]
        content.append(entry)
    return {"content": content}
