"""The step scheduler: which requests run this step, and how many tokens each.

One `schedule()` per engine step. It never touches tensors or clocks, so the real engine and
the simulator drive the very same code. Policies (`SchedulerConfig.scheduler`):

- ``decode-first`` (Sarathi-Serve's decode-maximal batching, the default): every decoding
  request gets its token first, then partial prefills continue, then waiting requests are
  admitted FCFS; each prefill chunk takes what is left of ``max_num_batched_tokens``.
- ``vllm-v1``: one pass over the running list in admission order (decodes and partial prefills
  interleaved), then admission — vLLM V1's order, where an early long prefill can eat the budget.
- ``prefill-first`` (no chunking, vLLM V0's default): a step of whole prompts if any can be
  admitted, else a step of decodes only. Decodes wait for every prefill: head-of-line blocking.
- ``orca`` (no chunking): decodes plus whole prompts that fit the remaining budget, mixed.

With ``chunk_policy="adaptive"`` each step's budget is the decodes plus a prefill chunk sized
from a step-time model (core/chunk_budget.py); ``max_num_batched_tokens`` is then the cap.

When a block cannot be allocated the most recently admitted running request is preempted,
by recompute (KV dropped, it re-prefills prompt + output) or swap (KV copied to host).

With prefix caching, admission first looks up the request's longest cached prefix of full
blocks: those tokens count as computed, and its first chunk starts right after them, so the
budget is spent only on tokens still to compute. A recompute-preempted request's own blocks
stay cached after it is evicted, so its re-prefill usually hits most of them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace

from chunkserve.config import CacheConfig, SchedulerConfig
from chunkserve.core.chunk_budget import ChunkPlanner
from chunkserve.core.kv_cache import KVCacheManager, SwapSpace
from chunkserve.core.kv_groups import KVCacheGroups
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        num_swap_blocks: int = 0,
        kv_cache_groups: KVCacheGroups | None = None,
    ) -> None:
        # Defaults are decided once, by SchedulerConfig.resolve(); the scheduler only runs them.
        assert config.is_resolved, "the scheduler takes a resolved config (SchedulerConfig.resolve)"
        # adaptive: resolve() checked that the config carries a step-time model.
        self.planner: ChunkPlanner | None = None
        if config.chunk_policy == "adaptive":
            assert config.step_time is not None
            self.planner = ChunkPlanner(config.step_time, config.target_s,
                                        config.min_chunk_tokens, config.target_itl_ms is not None)
        self.config = config
        self.cache_config = cache_config
        self.kv = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            kv_cache_groups,
        )
        self.swap = SwapSpace(num_swap_blocks if cache_config.preemption_mode == "swap" else 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the next victim
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        # Per-step scratch, reset by schedule().
        self._budget = 0
        self._step_budget = 0
        self._scheduled: dict[str, ScheduledRequest] = {}
        self._stalled = False  # a running prefill found no memory: admit nobody past it
        self._out = SchedulerOutput(scheduled=[])

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Ends requests from outside the step (abort, stop string); unknown ids are ignored."""
        assert status.finished
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self._release(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (POST /reset_prefix_cache); see KVCacheManager."""
        return self.kv.reset_prefix_cache()

    def check_consistency(self) -> None:
        """Raises RuntimeError unless the queues and the KV pool add up: every queued request
        known, unfinished and in one queue only, and the pool's books (KVCacheManager's).
        Run after a failed step, before the next one."""
        queued = [r.request_id for r in (*self.waiting, *self.running)]
        problems = [f"{rid} queued twice" for rid in set(queued) if queued.count(rid) > 1]
        problems += [f"{r.request_id} queued but {r.status.name}"
                     for r in (*self.waiting, *self.running)
                     if r.status.finished or self.requests.get(r.request_id) is not r]
        problems += [f"{rid} known but in no queue" for rid in self.requests.keys() - set(queued)]
        problems += self.kv.check_consistency(set(self.requests))
        if problems:
            raise RuntimeError("the scheduler's state is inconsistent: " + "; ".join(problems[:5]))

    def _release(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self.swap.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._budget = self._step_budget = self._token_budget()
        self._scheduled = {}
        self._stalled = False
        self._out = SchedulerOutput(scheduled=[], finished_req_ids=self._finished_ids)
        self._finished_ids = []

        policy = self.config.scheduler
        if policy == "decode-first":
            self._schedule_decodes()
            self._schedule_partial_prefills()
            self._admit_waiting()
        elif policy == "vllm-v1":
            self._schedule_running_in_order()
            self._admit_waiting()
        elif policy == "prefill-first":
            self._admit_waiting()
            if not self._scheduled:
                self._schedule_decodes()
        elif policy == "orca":
            self._schedule_decodes()
            self._admit_waiting()
        else:  # resolve() rejects unknown names; this guards against later edits
            raise AssertionError(policy)

        out = self._out
        out.scheduled = list(self._scheduled.values())
        out.kv_stats = self.kv.stats()
        out.prefix_cache_stats = replace(self.kv.prefix_stats)
        out.num_running = len(self.running)
        out.num_waiting = len(self.waiting)
        out.token_budget = self._step_budget
        return out

    def _schedule_decodes(self) -> None:
        for req in list(self.running):
            if self._budget <= 0:
                break
            if req.status is RequestStatus.RUNNING and req.is_decoding:
                self._try_schedule(req, 1, may_preempt=True)

    def _schedule_partial_prefills(self) -> None:
        for req in list(self.running):
            if self._budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in self._scheduled:
                continue
            # With decodes already in the step, a prefill that finds no memory waits for them
            # to free blocks rather than evicting someone; alone, it must make room to progress.
            if not self._try_schedule(req, self._chunk(req), may_preempt=not self._scheduled):
                self._stalled = True
                break

    def _schedule_running_in_order(self) -> None:
        for req in list(self.running):
            if self._budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:
                self._try_schedule(req, self._chunk(req), may_preempt=True)

    def _admit_waiting(self) -> None:
        # vLLM: no admission in a step that preempted, or one whose prefills stalled on memory.
        if self._out.preempted_req_ids or self._stalled:
            return
        while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._peek_waiting()
            # A swapped-out request brings its own KV back; anyone else may hit the cache.
            hits = None if req.swapped_out else self.kv.get_computed_blocks(req)
            num_hit = hits.num_blocks * self.kv.block_size if hits else 0
            n = self._chunk(req, num_hit)
            if not self.config.chunked and n < req.num_uncomputed_tokens - num_hit:
                break  # a whole prompt must fit the step: wait for a step with more budget
            expected = min(req.num_prompt_tokens + self._max_tokens(req), self.config.max_model_len)
            start = req.num_computed_tokens + num_hit
            if self.kv.allocate_slots(req.request_id, start + n, expected, hits,
                                      num_computed=start) is None:
                break  # strict FCFS: nobody overtakes a request that does not fit
            self._remove_waiting(req)
            self._out.admitted_req_ids.append(req.request_id)
            self._apply_hit(req, num_hit)
            if req.swapped_out:
                self._out.blocks_to_swap_in += self.swap.swap_in(
                    req.request_id, self.kv.restored_blocks(req.request_id)
                )
                req.swapped_out = False
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._commit(req, n)

    # ---- helpers --------------------------------------------------------------------------------
    def _token_budget(self) -> int:
        """This step's budget: the static cap, or the decodes plus the adaptive chunk."""
        cap = self.config.max_num_batched_tokens
        assert cap is not None  # resolve() filled it
        if self.planner is None:
            return cap
        decodes = [r for r in self.running if r.status is RequestStatus.RUNNING and r.is_decoding]
        decodes = decodes[:cap]  # more than the cap cannot run this step anyway
        prefill = next((r for r in self.running
                        if r.status is RequestStatus.RUNNING and not r.is_decoding), None)
        if prefill is None and self.waiting:
            prefill = self._peek_waiting()
        if prefill is None:
            return cap  # decodes only: nothing for the policy to size
        chunk = self.planner.prefill_tokens(
            len(decodes), sum(r.num_computed_tokens + 1 for r in decodes),
            self._prefill_context(prefill), cap - len(decodes),
        )
        return len(decodes) + chunk

    def _prefill_context(self, req: Request) -> int:
        """Tokens the request's next chunk attends to: computed ones, plus for a request still
        waiting the prefix-cache hit it will get at admission (the lookup takes no reference)."""
        if req.status is RequestStatus.RUNNING or req.swapped_out:
            return req.num_computed_tokens
        hit = self.kv.get_computed_blocks(req)
        return req.num_computed_tokens + hit.num_blocks * self.kv.block_size

    def _apply_hit(self, req: Request, num_hit: int) -> None:
        """An admitted request skips its cached tokens; the lookup is counted once here."""
        if not req.swapped_out and self.kv.enable_caching:
            self.kv.record_lookup(req.num_tokens, num_hit)
            self._out.prefix_cache_queries += req.num_tokens
            self._out.prefix_cache_hits += num_hit
        req.num_computed_tokens += num_hit
        if req.num_cached_tokens < 0:  # what the client is told: the hit at first schedule
            req.num_cached_tokens = num_hit

    def _chunk(self, req: Request, num_cached: int = 0) -> int:
        """Tokens to compute this step, after the first `num_cached` uncomputed ones (a hit)."""
        n = req.num_uncomputed_tokens - num_cached
        threshold = self.config.long_prefill_token_threshold
        # A chunk-size cap: only meaningful when chunking. A no-chunk policy must run the whole
        # prompt in one step, so capping it there would leave the prompt waiting forever.
        if threshold > 0 and self.config.chunked:
            n = min(n, threshold)
        return min(n, self._budget)

    def _max_tokens(self, req: Request) -> int:
        max_tokens = req.sampling_params.max_tokens
        return self.config.max_model_len if max_tokens is None else max_tokens

    def _try_schedule(self, req: Request, n: int, may_preempt: bool) -> bool:
        """Allocates KV for `n` more tokens of a running request and adds it to the step."""
        if n <= 0:
            return False
        while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n,
                                     num_computed=req.num_computed_tokens) is None:
            if not may_preempt:
                return False
            victim = self._pick_victim()
            self._preempt(victim)
            if victim is req:
                return False
        self._commit(req, n)
        return True

    def _commit(self, req: Request, n: int) -> None:
        rid = req.request_id
        start = req.num_computed_tokens
        self._scheduled[rid] = ScheduledRequest(
            request=req,
            num_new_tokens=n,
            start=start,
            is_decode=req.is_decoding,
            block_tables=self.kv.tables[rid],
            samples=start + n == len(req.all_token_ids),
        )
        # Optimistic, as in vLLM: the tokens count as computed once scheduled.
        req.num_computed_tokens = start + n
        self._budget -= n
        self.kv.cache_blocks(req, req.num_computed_tokens)

    def _pick_victim(self) -> Request:
        candidates = [r for r in self.running if r.request_id not in self._scheduled]
        if self.config.scheduling_policy == "priority":
            # Lowest priority (largest value), then latest arrival.
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        live = self.kv.live_blocks(req.request_id)
        if self.swap.can_swap_out(len(live)):
            self._out.blocks_to_swap_out += self.swap.swap_out(req.request_id, live)
            req.swapped_out = True
        else:  # recompute (also the fallback when the swap space is full)
            req.num_computed_tokens = 0
        self.kv.free(req.request_id, keep_shape=req.swapped_out)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._out.preempted_req_ids.append(req.request_id)

    def _peek_waiting(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _remove_waiting(self, req: Request) -> None:
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    # ---- after the step -------------------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Appends sampled tokens, applies the token-level stop rules, frees finished requests.

        Returns the requests that got a token this step (finished ones included). Stop strings
        need text, so the engine checks them and calls `finish_requests`.
        """
        updated: list[Request] = []
        for sr in output.scheduled:
            req = sr.request
            token = sampled.get(req.request_id)
            if token is None or req.status is not RequestStatus.RUNNING:
                continue
            req.append_output_token(token)
            status = self._check_stop(req, token)
            if status is not None:
                self.running.remove(req)
                req.status = status
                self._release(req)
            updated.append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
