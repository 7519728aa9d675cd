"""What completions and chat share: tokenize off the loop, validate, fan out n × prompts, merge."""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.model.tokenizer import Tokenizer
from chunkserve.outputs import RequestOutput
from chunkserve.sampling_params import SamplingParams
from chunkserve.serve.async_engine import AsyncEngine


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


@dataclass
class PreparedPrompt:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Serving:
    def __init__(
        self,
        async_engine: AsyncEngine,
        model_name: str,
        max_waiting_requests: int | None = None,
    ) -> None:
        self.async_engine = async_engine
        self.engine: LLMEngine = async_engine.engine
        self.tokenizer: Tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = self.engine.max_model_len
        self.max_waiting_requests = max_waiting_requests

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Tokenization runs in a worker thread: neither the event loop nor the engine waits.
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def prepare(
        self,
        prompts: list[str | list[int]],
        make_params: Callable[[int], SamplingParams],
        add_special_tokens: bool = True,
    ) -> list[PreparedPrompt]:
        """Tokenizes and validates every prompt; `make_params(default_max_tokens)`."""
        prepared = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = await self.tokenize(prompt, add_special_tokens)
                text: str | None = prompt
            else:
                ids, text = list(prompt), None
            try:
                params = make_params(max(self.max_model_len - len(ids), 1))
                params = self.engine.prepare_params(ids, params)
            except ValueError as e:
                raise ApiError(400, str(e)) from e
            prepared.append(PreparedPrompt(text, ids, params))
        return prepared

    def check_capacity(self, num_new: int) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self.async_engine.num_queued + num_new > limit:
            raise ApiError(
                503,
                f"The server is overloaded: {self.async_engine.num_queued} requests are waiting "
                f"(--max-waiting-requests {limit}). Retry later.",
                "ServiceUnavailableError",
                headers={"Retry-After": "1"},
            )
        if not self.async_engine.is_healthy:
            raise ApiError(503, "The engine is not running.", "ServiceUnavailableError")

    async def generate(
        self, base_id: str, prompts: list[PreparedPrompt], n: int, priority: int
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs n samples of every prompt; yields (choice index, output) as they come.

        Choice index = prompt index * n + sample index, as in vLLM. Closing this iterator
        (a disconnect, an error) cancels every sub-request, which aborts it in the engine.
        Callers check_capacity() first, while an error can still be an HTTP status.
        """
        merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, prompt: PreparedPrompt, params: SamplingParams) -> None:
            try:
                async for out in self.async_engine.generate(
                    f"{base_id}-{index}", prompt.token_ids, params, priority
                ):
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
                params = prompt.params
                if j and params.seed is not None:
                    # n samples of one seeded request must differ but stay reproducible.
                    params = _reseed(params, params.seed + j)
                index = p_index * n + j
                tasks.append(asyncio.create_task(pump(index, prompt, params)))
        remaining = len(tasks)
        try:
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
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


def _reseed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
