"""What completions and chat share: tokenize off the loop, validate, admit, fan out n × prompts,
merge."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import fields, replace
from typing import Any

import jinja2
from fastapi import Request

from chunkserve.engine.processor import EngineRequest, Processor
from chunkserve.tokenizer.tokenizer import Tokenizer
from chunkserve.outputs import RequestOutput
from chunkserve.sampling_params import INT64_MIN, SamplingParams
from chunkserve.serve.admission import Admission, ClientGone, Refused
from chunkserve.frontend.async_engine import (
    AsyncEngine,
    RequestFailedError,
    ShuttingDownError,
    Ticket,
)
from chunkserve.serve.openai.chat_prompt import render_chat_prompt
from chunkserve.serve.openai.prompt_bound import TokenCountBound
from chunkserve.serve.openai.protocol import MAX_SEQUENCES

log = logging.getLogger("chunkserve.server")


class ApiError(Exception):
    """An error the client should see as `{"error": {...}}` with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.headers = headers


class Serving:
    def __init__(
        self,
        async_engine: AsyncEngine,
        model_name: str,
        max_waiting_requests: int | None = None,
        tool_call_parser: str | None = None,
        count_rejected: Callable[[str], None] | None = None,
    ) -> None:
        """`count_rejected(reason)`: counts a request refused at admission (the metrics')."""
        self.async_engine = async_engine
        self._count_rejected = count_rejected
        # Read-only from the HTTP threads: validation never waits for the engine loop.
        self.processor: Processor = async_engine.processor
        self.tokenizer: Tokenizer = self.processor.tokenizer  # type: ignore[assignment]
        self.model_name = model_name
        self.max_model_len = self.processor.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.admission = Admission(async_engine, max_waiting_requests)
        self.token_bound = TokenCountBound(self.tokenizer)
        self.tool_call_parser = tool_call_parser  # for tool_choice "auto"; None refuses it

    def render_token(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Tokenization runs in a worker thread: neither the event loop nor the engine waits.
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          continue_final_message: bool = False,
                          template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to `messages` (and tools, documents, chat_template_kwargs:
        serve/openai/chat_prompt.py), in a worker thread; 400 when it refuses them.

        Any exception from rendering is the request's doing, as in vLLM's
        safe_apply_chat_template: a template raises for conversations it cannot format (roles
        out of order, a missing field), and its expressions raise on the values a client put
        in chat_template_kwargs or the messages (jinja2's errors are not ValueErrors, and used
        to surface as 500s).
        """
        try:
            return await asyncio.to_thread(render_chat_prompt, self.tokenizer, messages,
                                           add_generation_prompt, continue_final_message,
                                           template_kwargs)
        except Exception as e:  # noqa: BLE001 - the client's input, reported back as a 400
            log.debug("chat template refused a request", exc_info=True)
            detail = str(e) if isinstance(e, ValueError | jinja2.TemplateError) else repr(e)
            raise ApiError(400, f"The chat template could not format these messages: {detail}",
                           param="messages") from e

    async def tokenize_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes a prompt, first refusing text that cannot fit without tokenizing it:
        tokenizing a few MiB costs seconds of CPU, only to be refused for its length."""
        at_least = self.token_bound.at_least(text)
        if at_least >= self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has at least {at_least} input tokens. Please reduce the length of "
                "the input messages.",
            )
        return await self.tokenize(text, add_special_tokens)

    async def prepare(
        self,
        prompts: list[str | list[int]],
        make_params: Callable[[int | None], SamplingParams],
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> list[EngineRequest]:
        """Tokenizes every prompt and runs it through the engine's Processor (a 400 when it
        refuses). `make_params(default_max_tokens)` gets None: the Processor fills in what is
        left of the context. The request ids are set per sub-request by generate()."""
        prepared = []
        for prompt in prompts:
            ids = (await self.tokenize_prompt(prompt, add_special_tokens)
                   if isinstance(prompt, str) else list(prompt))
            try:
                params = make_params(None)  # its ValueErrors are the client's 400s too
                if params.structured_outputs is None:
                    request = self.processor.process_inputs("", ids, params, priority=priority)
                else:  # compiling a grammar takes milliseconds: not on the event loop
                    request = await asyncio.to_thread(self.processor.process_inputs, "", ids,
                                                      params, priority=priority)
            except ValueError as e:
                raise ApiError(400, str(e), param=_param_named_in(str(e))) from e
            prepared.append(replace(request, prompt=prompt if isinstance(prompt, str) else None))
        return prepared

    def check_size(self, num_prompts: int, n: int, param: str = "n") -> None:
        """400 for a request that no amount of waiting would let in; call before tokenizing.
        `n`: the sequences run per prompt, named `param` (best_of when that is what runs)."""
        num, limit = num_prompts * n, self.max_waiting_requests
        plural = "s" if num_prompts > 1 else ""
        what = f"{num} sequences ({param}={n} × {num_prompts} prompt{plural})"
        if num > MAX_SEQUENCES or (limit is not None and num > limit):
            self.count_rejected("too_many_sequences")
        if num > MAX_SEQUENCES:
            raise ApiError(400, f"This request asks for {what}; at most {MAX_SEQUENCES} are "
                           "allowed.", param=param)
        if limit is not None and num > limit:
            raise ApiError(
                400,
                f"This request asks for {what}, more than this server ever queues at once "
                f"(--max-waiting-requests {limit}), so it could never be admitted. Send fewer "
                f"prompts or a smaller {param}.",
                param=param,
            )

    def count_rejected(self, reason: str) -> None:
        if self._count_rejected is not None:
            self._count_rejected(reason)

    async def admit(self, num_new: int, raw: Request | None = None) -> Ticket:
        """Reserves queue places for `num_new` sub-requests, or 503 when they do not fit.

        The rule is serve/admission.py's: a request that fits is admitted with no await between
        check and reservation (simultaneous arrivals cannot all pass the check); one of size 1
        that does not fit is refused at once; a bigger one may wait for places to free (while
        `raw`'s client stays connected). The caller must `release()` the ticket when done (a
        no-op once every place has been used).
        """
        disconnected = None if raw is None else _disconnect_of(raw)
        try:
            return await self.admission.admit(num_new, disconnected)
        except Refused as e:
            self.count_rejected(e.reason)
            headers = {"Retry-After": "1"} if e.reason == "queue_full" else None
            raise ApiError(503, e.message, "ServiceUnavailableError", headers=headers) from e
        except ClientGone as e:  # nobody reads this answer
            raise ApiError(499, "The client closed the request while it waited for queue "
                           "places.", "ClientClosedRequest") from e

    async def generate(
        self, base_id: str, prompts: list[EngineRequest], n: int, ticket: Ticket | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs n samples of every prompt; yields (choice index, output) as they come.

        Choice index = prompt index * n + sample index, as in vLLM. Closing this iterator
        (a disconnect, an error) cancels every sub-request, which aborts it in the engine.
        Callers admit() first, while an error can still be an HTTP status, and pass its ticket.
        """
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, request: EngineRequest) -> None:
            try:
                async for out in self.async_engine.generate(request, ticket):
                    merged.put_nowait((index, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                merged.put_nowait(e)
            finally:
                merged.put_nowait(None)

        tasks = []
        for p_index, prompt in enumerate(prompts):
            for j in range(n):
                params = prompt.sampling_params
                if j and params.seed is not None:
                    # n samples of one seeded request must differ but stay reproducible.
                    params = _reseed(params, params.seed + j)
                index = p_index * n + j
                request = replace(prompt, request_id=f"{base_id}-{index}", sampling_params=params)
                tasks.append(asyncio.create_task(pump(index, request)))
        remaining = len(tasks)
        try:
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ShuttingDownError):
                    raise ApiError(503, "The server is shutting down; the request was aborted "
                                   "at the end of its grace period.",
                                   "ServiceUnavailableError") from item
                elif isinstance(item, RequestFailedError) and item.status == 400:
                    raise ApiError(400, str(item)) from item
                elif isinstance(item, BaseException):
                    raise ApiError(500, str(item), "InternalServerError") from item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _disconnect_of(raw: Request) -> Callable[[], Awaitable[None]]:
    async def disconnected() -> None:
        # The body has been read: the only message left on the connection is the disconnect.
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    return disconnected


def get_serving(request: Request) -> Serving:
    """The app's Serving, for the routers' `Depends`: routes live in modules of their own and
    reach the server's state through the request, not through an import of the app."""
    serving: Serving = request.app.state.serving
    return serving


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)


def _param_named_in(message: str) -> str | None:
    """The field a SamplingParams message is about: each starts with it ("top_k must be ...")."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_FIELDS else None


def _reseed(params: SamplingParams, seed: int) -> SamplingParams:
    # Wrapped into int64: seed + j may pass the top of the range a client may send.
    return replace(params, seed=(seed - INT64_MIN) % (1 << 64) + INT64_MIN)
