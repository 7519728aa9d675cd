"""What one `Scheduler.schedule()` call decides: the step's batch, and the cache moves it needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chunkserve.core.kv_cache import KVCacheStats, PrefixCacheStats
from chunkserve.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step: the first new token's position
    is_decode: bool
    # The manager's live tables, one per KV-cache group (already grown for this step); a
    # sliding-window group's has NULL_BLOCK holes where its blocks left the window.
    block_tables: list[list[int]]
    # Whether this step catches the request up, so that it yields a new token. Decided when
    # scheduled (start + num_new_tokens == num_tokens then): the token count grows afterwards.
    samples: bool

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_req_ids: list[str] = field(default_factory=list)
    # Left the waiting queue this step: admitted, or resumed after a preemption.
    admitted_req_ids: list[str] = field(default_factory=list)
    # Finished (or aborted) since the previous step: the runner drops their per-request state.
    finished_req_ids: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    kv_stats: KVCacheStats | None = None
    num_running: int = 0
    num_waiting: int = 0
    token_budget: int = 0  # the step's token budget (static, or the adaptive policy's choice)
    # Prefix-cache lookups of this step's admissions (tokens), and the running totals.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_stats: PrefixCacheStats | None = None
    # Structured outputs: request id -> the bitmask row of the tokens its sample may take
    # (filled by the engine's grammar matchers, opaque here), for the rows that sample.
    grammar_bitmask: dict[str, Any] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out
