"""A request: `num_computed_tokens` chasing `num_tokens`.

There is no prefill/decode phase flag. A request is *decoding* when exactly one token (the last
sampled one) has no KV yet and it has produced output; everything else is prefill work — a new
prompt, a partial chunked prefill, or a preempted request recomputing prompt + output.
"""
from __future__ import annotations

import enum

from chunkserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue (KV freed, or swapped to host)
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    # This request alone failed in a step that ran (vLLM's FinishReason.ERROR): its own row's
    # logits or grammar, its detokenizer; the step's other requests go on.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        eos_token_ids: list[int] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.eos_token_ids = list(eos_token_ids or [])
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Set while the request's KV lives in the host swap pool (swap preemption).
        self.swapped_out = False
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Prefix caching: hashes of the full blocks of `all_token_ids`, filled in lazily by the
        # KV cache manager; and what else keys the KV besides the tokens (e.g. a LoRA id).
        self.block_hashes: list[bytes] = []
        self.cache_extra_keys: tuple[object, ...] = ()
        # Prompt tokens found in the prefix cache when first scheduled; -1 until then.
        self.num_cached_tokens = -1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        # Spelled out with len(): this runs for every running request in every step.
        return (len(self.output_token_ids) > 0
                and len(self.all_token_ids) - self.num_computed_tokens == 1)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
