"""POST /v1/completions and /v1/chat/completions, streaming (SSE) and not."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from chunkserve.engine.processor import EngineRequest
from chunkserve.outputs import RequestOutput
from chunkserve.serve.openai import bodies as R
from chunkserve.frontend.async_engine import Ticket
from chunkserve.serve.openai.chat_protocol import ChatCompletionRequest
from chunkserve.serve.http.errors import error_body
from chunkserve.serve.openai.protocol import CompletionRequest
from chunkserve.serve.http.sse import SSEResponse, until_disconnect
from chunkserve.serve.openai.serving import ApiError, Serving, get_serving
from chunkserve.serve.openai.tools.tool_choice import ToolCallReader, tool_call_parser
from chunkserve.serve.openai.tools.parsers import ToolCallParser

log = logging.getLogger("chunkserve.server")
router = APIRouter()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Choices:
    """Per-choice bookkeeping while a request streams: what was already sent."""

    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}  # choice index -> output tokens already reported
        self.finals: dict[int, RequestOutput] = {}
        self.text_offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def new_logprobs(self, index: int, out: RequestOutput) -> list[Any] | None:
        c = out.outputs[0]
        start = self.tokens.get(index, 0)
        self.tokens[index] = len(c.token_ids)
        return None if c.logprobs is None else c.logprobs[start:]

    def completion_tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.finals.values())


def _check(req: CompletionRequest | ChatCompletionRequest, serving: Serving) -> None:
    """404 for another model; unknown fields are accepted, as vLLM does, with a warning."""
    serving.check_model(req.model)
    unknown = req.unknown_fields()
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(unknown))


@router.post("/v1/completions", response_model=None)
async def completions(
    req: CompletionRequest, raw: Request, serving: Serving = Depends(get_serving)
) -> Response:
    _check(req, serving)
    samples = req.samples_per_prompt  # best_of, else n: what runs and what admission counts
    serving.check_size(len(req.prompts()), samples, "best_of" if samples > req.n else "n")
    prompts = await serving.prepare(req.prompts(), req.to_sampling_params, req.priority,
                                    add_special_tokens=req.add_special_tokens)
    echoes = [_echo_text(p, serving) if req.echo else "" for p in prompts]
    ticket = await serving.admit(len(prompts) * samples, raw)
    rid, created = R.completion_id(), int(time.time())
    stream = serving.generate(rid, prompts, samples, ticket)
    render_token = _renderer(req, serving)
    if req.stream:  # best_of == n here: the protocol refuses to stream a ranking
        return _sse(_completion_events(
            req, rid, created, prompts, stream, serving, render_token, echoes), ticket)
    result = await _collect_unless_disconnected(raw, stream, ticket)
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    chosen = _best_of(result, len(prompts), samples, req.n) if req.ranks_samples else result
    choices = []
    for i, out in sorted(chosen.items()):
        c = out.outputs[0]
        logprobs = None
        if req.logprobs is not None:  # else any logprobs were only best_of's, for ranking
            positions = [*((req.echo and _echo_positions(out)) or ()), *(c.logprobs or ())]
            logprobs = R.completion_logprobs(positions, render_token)
        choices.append(R.completion_choice(i, echoes[i // req.n] + c.text, c.finish_reason,
                                           logprobs))
    # Every sample's tokens count, also those best_of did not return (as OpenAI bills them).
    usage = R.usage(_prompt_tokens(prompts), sum(len(o.outputs[0].token_ids) for o in result.values()),
                    _cached_tokens(result, samples))
    return JSONResponse(R.completion_response(rid, serving.model_name, choices, usage, created))


@router.post("/v1/chat/completions", response_model=None)
async def chat(
    req: ChatCompletionRequest, raw: Request, serving: Serving = Depends(get_serving)
) -> Response:
    _check(req, serving)
    serving.check_size(1, req.n)
    try:
        tool_parser = tool_call_parser(req.tool_choice, req.tools, serving.tool_call_parser)
    except ValueError as e:
        raise ApiError(400, str(e), param="tool_choice") from e
    text = await serving.render_chat(req.message_dicts(), req.add_generation_prompt,
                                     req.continue_final_message, req.template_kwargs())
    prompts = await serving.prepare([text], req.to_sampling_params, req.priority,
                                    add_special_tokens=req.add_special_tokens)
    ticket = await serving.admit(req.n, raw)
    rid, created = R.chat_completion_id(), int(time.time())
    stream = serving.generate(rid, prompts, req.n, ticket)
    render_token = _renderer(req, serving)
    if req.stream:
        readers = _tool_readers(tool_parser, req)
        return _sse(_chat_events(req, rid, created, prompts, stream, serving, render_token,
                                 readers), ticket)
    result = await _collect_unless_disconnected(raw, stream, ticket)
    if result is None:
        return Response(status_code=499)
    readers = _tool_readers(tool_parser, req)
    choices = [_chat_choice(i, out, render_token, readers[i] if readers else None)
               for i, out in sorted(result.items())]
    usage = R.usage(_prompt_tokens(prompts), sum(len(o.outputs[0].token_ids) for o in result.values()),
                    _cached_tokens(result, req.n))
    return JSONResponse(R.chat_response(rid, serving.model_name, choices, usage, created))


def _tool_readers(parser: ToolCallParser | None,
                  req: ChatCompletionRequest) -> dict[int, ToolCallReader] | None:
    """Per choice, what reads its tool calls; None when replies are plain text."""
    if parser is None:
        return None
    return {i: ToolCallReader(parser, req.parallel_tool_calls) for i in range(req.n)}


def _chat_choice(index: int, out: RequestOutput, render: Any,
                 reader: ToolCallReader | None) -> dict[str, Any]:
    c = out.outputs[0]
    logprobs = None if c.logprobs is None else R.chat_logprobs(c.logprobs, render)
    if reader is None:
        return R.chat_choice(index, c.text, c.finish_reason, logprobs)
    content, calls, reason = reader.message(c.text, c.finish_reason)
    return R.chat_choice(index, content, reason, logprobs, calls)


async def _collect(stream: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, out in stream:
        if out.finished:
            finals[index] = out
    return finals


async def _collect_unless_disconnected(
    raw: Request, stream: AsyncIterator[tuple[int, RequestOutput]], ticket: Ticket
) -> dict[int, RequestOutput] | None:
    """The finished outputs, or None when the client hung up first (everything aborted)."""
    try:
        return await until_disconnect(raw, _collect(stream))
    finally:
        ticket.release()  # places never used: the client left before they were sent


def _best_of(finals: dict[int, RequestOutput], num_prompts: int, best_of: int,
             n: int) -> dict[int, RequestOutput]:
    """The n of each prompt's best_of samples to return, re-indexed prompt * n + 0..n-1.

    vLLM's rule (V0, best_of > n): the samples with the highest cumulative logprob, the sum of
    the logprobs of their generated tokens (here the engine's logprobs of each sampled token, as
    the raw logits give them), best first; ties keep the sample order. Samples are not
    length-normalized, so a shorter one (an early EOS or stop) can win. A sample without
    logprobs (aborted before its first token) ranks last.
    """
    def score(out: RequestOutput) -> float:
        logprobs = out.outputs[0].logprobs
        if not logprobs:
            return float("-inf")
        return sum(float(pairs[0][1]) for pairs in logprobs)

    chosen: dict[int, RequestOutput] = {}
    for p in range(num_prompts):
        outs = [finals[i] for i in range(p * best_of, (p + 1) * best_of) if i in finals]
        ranked = sorted(outs, key=score, reverse=True)  # sorted() is stable
        for j, out in enumerate(ranked[:n]):
            chosen[p * n + j] = out
    return chosen


def _echo_positions(out: RequestOutput) -> list[R.TokenLogprobs] | None:
    """The prompt's tokens as completion_logprobs positions, for echo with logprobs: the first
    has no logprob (nothing predicts it), then the engine's prompt logprobs (vLLM's shape)."""
    entries = out.prompt_logprobs
    if entries is None:  # finished before its prompt was scored (an abort)
        return None
    positions: list[R.TokenLogprobs] = []
    for i, token_id in enumerate(out.prompt_token_ids):
        entry = entries[i] if i < len(entries) else None
        positions.append([(token_id, None)] if i == 0 or entry is None else entry)
    return positions


def _renderer(req: CompletionRequest | ChatCompletionRequest, serving: Serving) -> Any:
    """How logprobs name a token: its text, or vLLM's "token_id:{id}" when asked."""
    if req.return_tokens_as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return serving.render_token


def _prompt_tokens(prompts: list[EngineRequest]) -> int:
    return sum(len(p.prompt_token_ids) for p in prompts)


def _cached_tokens(finals: dict[int, RequestOutput], n: int) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt like prompt_tokens
    (sequence i*n is the first sample of prompt i; its n samples share one prompt; n is the
    samples run per prompt, best_of when given)."""
    return sum(out.num_cached_tokens for index, out in finals.items() if index % n == 0)


def _completion_logprobs(logprobs: list[Any] | None, render: Any,
                         text_offset: int = 0) -> dict[str, Any] | None:
    return None if logprobs is None else R.completion_logprobs(logprobs, render, text_offset)


def _sse(events: AsyncIterator[str], ticket: Ticket) -> StreamingResponse:
    return SSEResponse(events, ticket)


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once streaming has begun an error can only travel as an event, then [DONE].

    Any exception, not only an ApiError: one escaping a started stream makes the HTTP server
    drop the connection mid-response, which the client sees as a truncated body.
    """
    try:
        async for event in events:
            yield event
    except ApiError as e:
        yield sse(error_body(e.message, e.err_type, e.status, e.param))
    except Exception as e:  # noqa: BLE001 - reported to the client, logged here
        log.exception("stream failed")
        yield sse(error_body(f"internal error while streaming: {e!r}", "InternalServerError",
                             500))
    yield "data: [DONE]\n\n"


def _echo_text(prompt: EngineRequest, serving: Serving) -> str:
    if prompt.prompt is not None:
        return prompt.prompt
    return serving.tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)


def _completion_events(req, rid, created, prompts, stream, serving, render, echoes):  # type: ignore[no-untyped-def]
    async def events() -> AsyncIterator[str]:
        seen = _Choices()
        model = serving.model_name
        # The echoed prompt is each choice's first chunk: at once, or with logprobs once the
        # engine has scored the prompt (its first output), as vLLM sends it.
        echo_pending = set(range(len(prompts) * req.n)) if req.echo else set()
        if req.logprobs is None:
            for index in sorted(echo_pending):
                yield sse(R.completion_chunk(rid, model, index, echoes[index // req.n], None,
                                             None, created))
            echo_pending.clear()
        async for index, out in stream:
            c = out.outputs[0]
            if index in echo_pending:
                echo_pending.discard(index)
                lp = _completion_logprobs(_echo_positions(out), render)
                if lp and lp["tokens"]:
                    seen.text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                yield sse(R.completion_chunk(rid, model, index, echoes[index // req.n], None,
                                             lp, created))
            if out.finished:
                seen.finals[index] = out
            if not c.delta_text and not out.finished:
                continue  # nothing visible yet (partial character, held-back stop prefix)
            # Taken only for a chunk that is sent, so held-back tokens' logprobs come later.
            logprobs = seen.new_logprobs(index, out)
            lp = _completion_logprobs(logprobs, render, seen.text_offsets.get(index, 0))
            if lp and lp["tokens"]:
                seen.text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            yield sse(R.completion_chunk(
                rid, model, index, c.delta_text, c.finish_reason, lp, created,
            ))
        if req.include_usage:
            usage = R.usage(_prompt_tokens(prompts), seen.completion_tokens(),
                            _cached_tokens(seen.finals, req.n))
            yield sse(R.usage_chunk(rid, model, "text_completion", usage, created))

    return _guarded(events())


def _chat_events(req, rid, created, prompts, stream, serving, render, readers):  # type: ignore[no-untyped-def]
    async def events() -> AsyncIterator[str]:
        seen = _Choices()
        model = serving.model_name
        for index in range(len(prompts) * req.n):  # the role comes first, as OpenAI sends it
            yield sse(R.chat_chunk(rid, model, index, R.chat_delta("", first=True), None,
                                   None, created))
        async for index, out in stream:
            c = out.outputs[0]
            if out.finished:
                seen.finals[index] = out
            delta, reason = R.chat_delta(c.delta_text), c.finish_reason
            if readers is not None:  # content and tool calls, as far as the text decides them
                delta, reason = readers[index].delta(c.delta_text, out.finished, reason)
            if not any(delta.values()) and not out.finished:
                continue
            logprobs = seen.new_logprobs(index, out)
            yield sse(R.chat_chunk(
                rid, model, index, delta, reason,
                None if logprobs is None else R.chat_logprobs(logprobs, render), created,
            ))
        if req.include_usage:
            usage = R.usage(_prompt_tokens(prompts), seen.completion_tokens(),
                            _cached_tokens(seen.finals, req.n))
            yield sse(R.usage_chunk(rid, model, "chat.completion.chunk", usage, created))

    return _guarded(events())
