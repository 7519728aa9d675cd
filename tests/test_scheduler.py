"""The step scheduler, driven by a fake runner (no model, no torch): budgets, policies, chunked
prefill, preemption, priority, stop rules, config resolution and import hygiene."""
from __future__ import annotations

import zlib

import ast
import math
import pathlib
import subprocess
import sys

import pytest

import chunkserve.core
from chunkserve.config import CacheConfig, EngineConfig, SchedulerConfig
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched_output import ScheduledRequest, SchedulerOutput
from chunkserve.core.scheduler import Scheduler
from chunkserve.sampling_params import SamplingParams

POLICIES = ("decode-first", "vllm-v1", "prefill-first", "orca")
CHUNKED = ("decode-first", "vllm-v1")
TOKEN = 7  # what the fake runner samples unless told otherwise
EOS = 2


# ---- helpers --------------------------------------------------------------------------------
def make_scheduler(
    policy: str = "decode-first",
    *,
    budget: int | None = None,
    max_model_len: int = 1024,
    num_blocks: int = 4096,
    block_size: int = 16,
    mode: str = "recompute",
    num_swap_blocks: int = 0,
    max_num_seqs: int = 256,
    threshold: int = 0,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        scheduler=policy,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        scheduling_policy=scheduling_policy,
    )
    cache = CacheConfig(block_size=block_size, preemption_mode=mode)
    return Scheduler(config.resolve(), cache, num_blocks, num_swap_blocks)


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int | None,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    eos: tuple[int, ...] = (EOS,),
    **params: object,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, **params)  # type: ignore[arg-type]
    # Prompt tokens never equal EOS/TOKEN, so the prompt content cannot matter; the first token
    # is the request's own, so no two requests share a prefix-cache block by accident.
    prompt = [1000 + zlib.crc32(rid.encode())] + [100 + i % 50 for i in range(1, prompt_len)]
    return Request(rid, prompt, sp, arrival, eos_token_ids=list(eos), priority=priority)


def fake_step_sampled(sched: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, set[str]]:
    """One engine step: schedule, then 'sample' `token` for every request that caught up.

    Returns the output and the ids that sampled (`samples` must be read before the update, since
    the appended token makes the request longer again)."""
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    sampled = {sr.request.request_id for sr in out.scheduled if sr.samples}
    if not sched.config.chunked:  # a no-chunk policy always runs a request's whole backlog
        assert len(sampled) == len(out.scheduled)
    sched.update_from_output(out, {rid: token for rid in sampled})
    return out, sampled


def fake_step(sched: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    return fake_step_sampled(sched, token)[0]


def run_to_completion(sched: Scheduler, max_steps: int = 20_000) -> list[SchedulerOutput]:
    outs: list[SchedulerOutput] = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(fake_step(sched))
    return outs


def entry(out: SchedulerOutput, rid: str) -> ScheduledRequest | None:
    return next((sr for sr in out.scheduled if sr.request.request_id == rid), None)


def assert_finished_by_length(reqs: list[Request]) -> None:
    for req in reqs:
        assert req.status is RequestStatus.FINISHED_LENGTH, req
        assert req.num_output_tokens == req.sampling_params.max_tokens


# ---- token budget ---------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_token_budget_never_exceeded(policy: str) -> None:
    """No step schedules more than max_num_batched_tokens, with long and short prompts mixed and
    requests arriving mid-run; everything still completes."""
    budget = 256 if policy in CHUNKED else 1024
    sched = make_scheduler(policy, budget=budget, max_model_len=1024)
    lengths = [900, 5, 300, 17, 700, 1, 64, 1000, 255, 256, 257, 3]
    reqs = [make_request(f"r{i}", n, 20, arrival=float(i)) for i, n in enumerate(lengths)]
    for req in reqs[:6]:
        sched.add_request(req)
    outs = [fake_step(sched) for _ in range(5)]
    for req in reqs[6:]:
        sched.add_request(req)
    outs += run_to_completion(sched)
    assert all(out.total_num_scheduled_tokens <= budget for out in outs)
    busiest = max(out.total_num_scheduled_tokens for out in outs)
    if policy in CHUNKED:
        assert busiest == budget  # chunking fills the budget exactly
    else:
        assert busiest > budget - 10  # whole prompts packed close to it (1018 / 1020 here)
    assert_finished_by_length(reqs)


# ---- decode-first ---------------------------------------------------------------------------
def test_decode_first_decodes_every_step_while_long_prompt_is_chunked() -> None:
    """Under decode-first, every decoding request gets exactly one token in every step while a
    long prompt is prefilled, and the prompt's chunk is exactly what the decodes leave over."""
    budget = 64
    sched = make_scheduler("decode-first", budget=budget)
    shorts = [make_request(f"s{i}", 8, 300) for i in range(3)]
    for req in shorts:
        sched.add_request(req)
    fake_step(sched)  # the short prompts fit one step; all three are decoding now
    assert all(r.is_decoding for r in shorts)

    long = make_request("long", 1000, 4)
    sched.add_request(long)
    chunks: list[int] = []
    while long.num_output_tokens == 0:
        decoding = [r.request_id for r in sched.running if r.is_decoding]
        assert len(decoding) == 3
        uncomputed = long.num_uncomputed_tokens
        out = fake_step(sched)
        for rid in decoding:
            sr = entry(out, rid)
            assert sr is not None and sr.num_new_tokens == 1 and sr.is_decode
        sr = entry(out, "long")
        assert sr is not None and not sr.is_decode
        assert sr.num_new_tokens <= budget - len(decoding)
        assert sr.num_new_tokens == min(uncomputed, budget - len(decoding))
        assert out.total_num_scheduled_tokens <= budget
        chunks.append(sr.num_new_tokens)
    assert sum(chunks) == 1000
    assert chunks[:-1] == [budget - 3] * (len(chunks) - 1)


@pytest.mark.parametrize("policy", CHUNKED)
@pytest.mark.parametrize("threshold", [0, 50])
def test_partial_prefill_resumes_where_it_stopped(policy: str, threshold: int) -> None:
    """Each chunk starts where the previous one ended, carries the matching prompt slice, and only
    the last chunk samples; the request has no output until then."""
    sched = make_scheduler(policy, budget=64, threshold=threshold, block_size=16)
    other = make_request("other", 10, 40)
    long = make_request("long", 300, 3)
    sched.add_request(other)
    sched.add_request(long)
    chunks: list[ScheduledRequest] = []
    samples: list[bool] = []
    while long.num_output_tokens == 0:
        out, sampled = fake_step_sampled(sched)
        sr = entry(out, "long")
        if sr is None:
            continue
        chunks.append(sr)
        samples.append("long" in sampled)
        assert len(sr.block_tables[0]) == math.ceil((sr.start + sr.num_new_tokens) / 16)
    assert chunks[0].start == 0
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur.start == prev.start + prev.num_new_tokens
    assert chunks[-1].start + chunks[-1].num_new_tokens == 300
    assert samples == [False] * (len(chunks) - 1) + [True]
    # Positions covered by the chunks are exactly the prompt, in order.
    assert [t for sr in chunks for t in sr.token_ids] == long.prompt_token_ids
    if threshold:
        assert all(sr.num_new_tokens <= threshold for sr in chunks)
    run_to_completion(sched)
    assert_finished_by_length([other, long])


# ---- vllm-v1 vs decode-first ----------------------------------------------------------------
def _two_request_setup(policy: str) -> tuple[Scheduler, Request, Request]:
    """Cache of 4 blocks x 4 tokens. A (12-token prompt) is admitted first, B (4 tokens) second;
    the chunk cap of 4 leaves budget for B, so after two steps A is a partial prefill holding
    2 blocks, B is decoding with 2 blocks, and the cache is full."""
    sched = make_scheduler(
        policy, budget=8, threshold=4, max_model_len=16, num_blocks=4, block_size=4
    )
    a = make_request("A", 12, 4)
    b = make_request("B", 4, 12)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    fake_step(sched)
    assert sched.running == [a, b]
    assert a.num_computed_tokens == 8 and not a.is_decoding
    assert b.is_decoding and sched.kv.pool.num_free == 0
    return sched, a, b


def test_vllm_v1_earlier_partial_prefill_starves_later_decode_decode_first_does_not() -> None:
    """vllm-v1 serves the running list in admission order, so the earlier-admitted partial
    prefill A claims its share of the step first: needing a block in a full cache, it preempts the
    later decode B, which gets no token this step. decode-first serves B's decode first; A, with
    decodes already in the step, does not evict anyone and simply waits.

    (With the token budget alone this cannot be staged here: a request is admitted only with
    budget left over after the earlier ones, whose later chunks never grow, so the contention that
    vllm-v1's order exposes shows up as KV memory.)"""
    sched, a, b = _two_request_setup("vllm-v1")
    out = fake_step(sched)
    assert entry(out, "B") is None  # the decode got no token
    assert out.preempted_req_ids == ["B"]
    sr = entry(out, "A")
    assert sr is not None and sr.num_new_tokens == 4 and not sr.is_decode

    sched, a, b = _two_request_setup("decode-first")
    out = fake_step(sched)
    sr = entry(out, "B")
    assert sr is not None and sr.is_decode and sr.num_new_tokens == 1
    assert entry(out, "A") is None  # the prefill waits for memory instead
    assert out.preempted_req_ids == []

    # Both orders still finish everything.
    run_to_completion(sched)
    assert_finished_by_length([a, b])


def test_vllm_v1_batches_in_admission_order_decode_first_puts_decodes_first() -> None:
    """With a partial prefill admitted before a decoding request, vllm-v1 lists the prefill chunk
    first in the batch; decode-first lists the decode first."""
    for policy, expected in (("vllm-v1", ["A", "B"]), ("decode-first", ["B", "A"])):
        sched = make_scheduler(policy, budget=8, threshold=4, max_model_len=64, num_blocks=64, block_size=4)
        sched.add_request(make_request("A", 40, 2))
        sched.add_request(make_request("B", 4, 10))
        fake_step(sched)
        out = fake_step(sched)
        assert [sr.request.request_id for sr in out.scheduled] == expected, policy
        assert entry(out, "B").is_decode and not entry(out, "A").is_decode  # type: ignore[union-attr]


# ---- no-chunk policies ----------------------------------------------------------------------
def _staggered(sched: Scheduler, prompt_lens: list[int], max_tokens: int) -> list[SchedulerOutput]:
    """Adds one request every other step, then runs to completion."""
    outs: list[SchedulerOutput] = []
    for i, n in enumerate(prompt_lens):
        sched.add_request(make_request(f"r{i}", n, max_tokens, arrival=float(i)))
        outs += [fake_step(sched), fake_step(sched)]
    return outs + run_to_completion(sched)


def test_prefill_first_steps_with_prefills_have_no_decodes() -> None:
    """prefill-first: a step that runs prompts runs no decodes, even though decodes are waiting
    (head-of-line blocking); prompts are never split."""
    sched = make_scheduler("prefill-first", budget=1024, max_model_len=1024)
    blocked = 0
    for i, n in enumerate([100, 500, 30, 900, 8, 400]):
        sched.add_request(make_request(f"r{i}", n, 10, arrival=float(i)))
        for _ in range(2):
            decoding = [r for r in sched.running if r.is_decoding]
            out = fake_step(sched)
            prefills = [sr for sr in out.scheduled if not sr.is_decode]
            if prefills:
                assert all(not sr.is_decode for sr in out.scheduled)
                blocked += bool(decoding)
    outs = run_to_completion(sched)
    assert blocked > 0  # some decodes really were held back by a prefill step
    for out in outs:
        kinds = {sr.is_decode for sr in out.scheduled}
        assert len(kinds) <= 1


def test_orca_mixes_decodes_with_whole_prompts() -> None:
    """orca: decodes and whole prompts share a step; a prompt is never split."""
    sched = make_scheduler("orca", budget=1024, max_model_len=1024)
    outs = _staggered(sched, [100, 500, 30, 900, 8, 400], 10)
    assert any(
        any(sr.is_decode for sr in out.scheduled) and any(not sr.is_decode for sr in out.scheduled)
        for out in outs
    )
    # fake_step checks that every scheduled request catches up (samples) under no-chunk policies.
    for out in outs:
        for sr in out.scheduled:
            if not sr.is_decode:
                assert sr.start == 0 and sr.num_new_tokens == sr.request.num_prompt_tokens


@pytest.mark.parametrize("policy", ["prefill-first", "orca"])
def test_no_chunk_policies_never_split_prompts(policy: str) -> None:
    """Even with a long_prefill_token_threshold set (a chunking knob), a no-chunk policy runs
    every prompt whole and in one step; it does not wait forever for a smaller prompt."""
    sched = make_scheduler(policy, budget=512, max_model_len=512, threshold=64)
    reqs = [make_request(f"r{i}", n, 5) for i, n in enumerate([300, 500, 64, 65])]
    for req in reqs:
        sched.add_request(req)
    outs = run_to_completion(sched)  # fake_step asserts every scheduled request samples
    for out in outs:
        for sr in out.scheduled:
            assert sr.is_decode or sr.num_new_tokens == sr.request.num_prompt_tokens
    assert_finished_by_length(reqs)


# ---- config resolution ----------------------------------------------------------------------
def test_no_chunk_budget_below_max_model_len_is_refused() -> None:
    """A no-chunk policy that could not fit a max-length prompt in a step is a config error."""
    for policy in ("prefill-first", "orca"):
        config = SchedulerConfig(scheduler=policy, max_num_batched_tokens=512, max_model_len=1024)
        with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) is smaller than "
                           r"max_model_len \(1024\).*chunked prefill"):
            config.resolve()
    # The engine's config resolves the same way.
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        EngineConfig.from_kwargs(scheduler="orca", max_num_batched_tokens=512).resolve(1024)


def test_chunked_prefill_flag_must_match_policy() -> None:
    """enable_chunked_prefill=False cannot run a chunking policy, nor True a no-chunk one."""
    with pytest.raises(ValueError, match="always chunks"):
        SchedulerConfig(scheduler="decode-first", enable_chunked_prefill=False).resolve()
    with pytest.raises(ValueError, match="always chunks"):
        SchedulerConfig(scheduler="vllm-v1", enable_chunked_prefill=False).resolve()
    with pytest.raises(ValueError, match="never chunks"):
        SchedulerConfig(scheduler="orca", enable_chunked_prefill=True).resolve()
    with pytest.raises(ValueError, match="scheduler must be one of"):
        SchedulerConfig(scheduler="sjf").resolve()


def test_config_defaults_resolve() -> None:
    """None → decode-first with a 2048 budget; chunking off → prefill-first, budget max_model_len."""
    config = SchedulerConfig().resolve()
    assert (config.scheduler, config.max_num_batched_tokens) == ("decode-first", 2048)
    assert config.enable_chunked_prefill is True and config.chunked

    config = SchedulerConfig(enable_chunked_prefill=False, max_model_len=4096).resolve()
    assert (config.scheduler, config.max_num_batched_tokens) == ("prefill-first", 4096)
    assert config.chunked is False

    config = SchedulerConfig(scheduler="orca", max_model_len=300).resolve()
    assert config.max_num_batched_tokens == 300 and config.enable_chunked_prefill is False

    config = SchedulerConfig(scheduler="vllm-v1").resolve()
    assert config.max_num_batched_tokens == 2048 and config.enable_chunked_prefill is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": 0},
        {"long_prefill_token_threshold": -1},
        {"scheduling_policy": "lifo"},
    ],
)
def test_bad_scheduler_values_are_refused(kwargs: dict[str, object]) -> None:
    """Non-positive sizes and unknown policies raise ValueError."""
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs).resolve()  # type: ignore[arg-type]


# ---- caps -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_max_num_seqs_caps_running(policy: str) -> None:
    """No more than max_num_seqs requests run at once; the rest wait their turn."""
    sched = make_scheduler(policy, max_num_seqs=2)
    reqs = [make_request(f"r{i}", 10, 5, arrival=float(i)) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    out = fake_step(sched)
    assert [sr.request.request_id for sr in out.scheduled] == ["r0", "r1"]
    assert out.num_running == 2 and out.num_waiting == 3
    for out in run_to_completion(sched):
        assert len(sched.running) <= 2 and out.num_running <= 2
        assert len(out.scheduled) <= 2
    assert_finished_by_length(reqs)


@pytest.mark.parametrize("policy", CHUNKED)
def test_long_prefill_token_threshold_caps_chunk_size(policy: str) -> None:
    """Each prefill chunk is at most long_prefill_token_threshold tokens, even with budget to spare,
    so two long prompts advance side by side."""
    sched = make_scheduler(policy, budget=2048, threshold=100)
    sched.add_request(make_request("a", 350, 2))
    sched.add_request(make_request("b", 250, 2))
    sizes: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(4):
        out = fake_step(sched)
        for sr in out.scheduled:
            if not sr.is_decode:
                sizes[sr.request.request_id].append(sr.num_new_tokens)
    assert sizes == {"a": [100, 100, 100, 50], "b": [100, 100, 50]}


# ---- preemption -----------------------------------------------------------------------------
def _pressure(
    policy: str = "decode-first", mode: str = "recompute", num_swap_blocks: int = 0
) -> tuple[Scheduler, list[Request]]:
    """6 blocks x 4 tokens; three requests with 4-token prompts that each decode to 16 tokens
    (4 blocks): they fit at admission, then outgrow the cache. A fourth waits on max_num_seqs."""
    sched = make_scheduler(
        policy,
        budget=64 if policy in CHUNKED else 24,
        max_model_len=24,
        num_blocks=6,
        block_size=4,
        mode=mode,
        num_swap_blocks=num_swap_blocks,
        max_num_seqs=3,
    )
    reqs = [make_request(f"r{i}", 4, 12, arrival=float(i)) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    return sched, reqs


def _step_until_preemption(sched: Scheduler) -> tuple[list[Request], SchedulerOutput]:
    """Steps until one preempts; returns the running list just before that step, and its output."""
    for _ in range(100):
        before = list(sched.running)
        out = fake_step(sched)
        if out.preempted_req_ids:
            return before, out
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_preemption_evicts_latest_admitted(policy: str) -> None:
    """Out of blocks, the scheduler evicts the most recently admitted running request; recompute
    drops its KV (num_computed_tokens = 0) and puts it first in the waiting queue."""
    sched, reqs = _pressure(policy)
    before, out = _step_until_preemption(sched)
    victim = next(r for r in reqs if r.request_id == out.preempted_req_ids[0])
    assert victim is before[-1]
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and not victim.swapped_out
    assert victim.request_id not in sched.kv.block_tables
    assert sched.waiting[0] is victim  # ahead of r3, which was waiting all along
    assert sched.waiting[-1].request_id == "r3"
    assert victim.num_preemptions == 1 and sched.num_preemptions >= 1
    assert out.blocks_to_swap_out == []

    outs = [out] + run_to_completion(sched)
    assert sched.num_preemptions == sum(len(o.preempted_req_ids) for o in outs)
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert_finished_by_length(reqs)


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_preemption_swaps_out_then_back_in(policy: str) -> None:
    """Swap mode copies the victim's blocks to host (blocks_to_swap_out), keeps its computed
    tokens, and on re-admission copies the same host blocks into its new device blocks."""
    sched, reqs = _pressure(policy, mode="swap", num_swap_blocks=16)
    tables = {}
    for _ in range(100):
        before = list(sched.running)
        tables = {rid: list(t) for rid, t in sched.kv.block_tables.items()}
        computed = {r.request_id: r.num_computed_tokens for r in reqs}
        out = fake_step(sched)
        if out.preempted_req_ids:
            break
    else:
        raise AssertionError("no preemption happened")
    victim = next(r for r in reqs if r.request_id == out.preempted_req_ids[0])
    assert victim is before[-1]
    assert victim.swapped_out and victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == computed[victim.request_id] > 0
    host = list(sched.swap.tables[victim.request_id])
    # All of the victim's device blocks go out, paired with its host blocks.
    assert out.blocks_to_swap_out == list(zip(tables[victim.request_id], host))
    assert sched.waiting[0] is victim

    outs = [out]
    while victim.swapped_out:
        out = fake_step(sched)
        outs.append(out)
        assert len(outs) < 100
    # Re-admitted: the same host blocks come back into the head of its new table.
    table = sched.kv.block_tables[victim.request_id]
    assert out.blocks_to_swap_in == list(zip(host, table[: len(host)]))
    sr = entry(out, victim.request_id)
    assert sr is not None and sr.start == computed[victim.request_id]  # no recomputation
    assert victim.num_preemptions == 1

    outs += run_to_completion(sched)
    swapped_out = sum(len(o.blocks_to_swap_out) for o in outs)
    swapped_in = sum(len(o.blocks_to_swap_in) for o in outs)
    assert swapped_out == swapped_in > 0
    assert sched.num_preemptions == sum(len(o.preempted_req_ids) for o in outs)
    assert sched.swap.num_used == 0
    assert_finished_by_length(reqs)


def test_aborting_swapped_out_request_frees_host_blocks() -> None:
    """A request aborted while swapped out gives its host blocks back."""
    sched, reqs = _pressure(mode="swap", num_swap_blocks=16)
    _, out = _step_until_preemption(sched)
    victim = out.preempted_req_ids[0]
    assert sched.swap.num_used > 0
    sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    assert sched.swap.num_used == 0 and not sched.swap.tables
    run_to_completion(sched)
    assert sched.kv.pool.num_free == sched.kv.num_blocks


def test_swap_falls_back_to_recompute_when_host_space_is_short() -> None:
    """A victim whose blocks do not fit the swap space is recomputed instead."""
    sched, reqs = _pressure(mode="swap", num_swap_blocks=1)
    _, out = _step_until_preemption(sched)
    victim = next(r for r in reqs if r.request_id == out.preempted_req_ids[0])
    assert out.blocks_to_swap_out == []
    assert not victim.swapped_out and victim.num_computed_tokens == 0
    assert sched.swap.num_used == 0
    run_to_completion(sched)
    assert_finished_by_length(reqs)


def test_swap_mode_needs_swap_blocks_and_recompute_ignores_them() -> None:
    """Swap blocks are only set up in swap mode; recompute never swaps even if some are offered."""
    sched, reqs = _pressure(mode="recompute", num_swap_blocks=16)
    assert sched.swap.pool is None
    outs = run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(not o.blocks_to_swap_out and not o.blocks_to_swap_in for o in outs)
    assert_finished_by_length(reqs)


# ---- priority -------------------------------------------------------------------------------
def test_priority_policy_admits_lower_values_first() -> None:
    """scheduling_policy=priority admits the smallest `priority` first, ties by arrival."""
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    prios = {"a": 2, "b": 0, "c": 1, "d": 0}
    for i, (rid, prio) in enumerate(prios.items()):
        sched.add_request(make_request(rid, 5, 2, arrival=float(i), priority=prio))
    order: list[str] = []
    for out in run_to_completion(sched):
        for sr in out.scheduled:
            if sr.request.request_id not in order:
                order.append(sr.request.request_id)
    assert order == ["b", "d", "c", "a"]


def test_fcfs_policy_ignores_priority() -> None:
    """Under fcfs, priority values do not reorder admission."""
    sched = make_scheduler(max_num_seqs=1)
    for i, prio in enumerate([2, 0, 1]):
        sched.add_request(make_request(f"r{i}", 5, 1, arrival=float(i), priority=prio))
    order = [out.scheduled[0].request.request_id for out in run_to_completion(sched)]
    assert order == ["r0", "r1", "r2"]


# ---- stop rules -----------------------------------------------------------------------------
def _generate(req: Request, tokens: list[int], max_model_len: int = 1024) -> Request:
    """Runs one request alone, sampling `tokens` in order, until it finishes."""
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(req)
    feed = iter(tokens)
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {sr.request.request_id: next(feed) for sr in out.scheduled if sr.samples}
        sched.update_from_output(out, sampled)
        steps += 1
        assert steps < 1000
    out = sched.schedule()
    assert out.finished_req_ids == [req.request_id] and out.kv_stats.num_used_blocks == 0  # type: ignore[union-attr]
    return req


def test_eos_stops_with_reason_stop() -> None:
    """Sampling an EOS id finishes the request with finish_reason 'stop'."""
    req = _generate(make_request("a", 5, 10), [5, 6, EOS, 8])
    assert req.output_token_ids == [5, 6, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.status.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens() -> None:
    """With ignore_eos, EOS is just a token: the request runs to max_tokens ('length')."""
    req = _generate(make_request("a", 5, 4, ignore_eos=True), [EOS] * 4)
    assert req.output_token_ids == [EOS] * 4
    assert req.status.finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    """EOS and stop_token_ids only stop once min_tokens outputs exist."""
    req = _generate(make_request("a", 5, 10, min_tokens=3), [EOS, EOS, EOS, EOS])
    assert req.output_token_ids == [EOS, EOS, EOS]
    assert req.status.finish_reason == "stop"
    req = _generate(make_request("b", 5, 10, min_tokens=2, stop_token_ids=[9]), [9, 9, 9])
    assert req.num_output_tokens == 2 and req.stop_reason == 9


def test_stop_token_ids_stop_and_record_reason() -> None:
    """A stop token id finishes with 'stop' and is recorded as stop_reason."""
    req = _generate(make_request("a", 5, 10, stop_token_ids=[9, 11]), [5, 11, 9])
    assert req.output_token_ids == [5, 11]
    assert req.status.finish_reason == "stop" and req.stop_reason == 11


def test_max_tokens_stops_with_reason_length() -> None:
    """Reaching max_tokens finishes with 'length'."""
    req = _generate(make_request("a", 5, 3), [5, 6, 8, 9])
    assert req.output_token_ids == [5, 6, 8]
    assert req.status.finish_reason == "length" and req.stop_reason is None


def test_max_model_len_stops_with_reason_length() -> None:
    """With no max_tokens, the request stops once prompt + output reaches max_model_len."""
    req = _generate(make_request("a", 7, None), [5] * 10, max_model_len=10)
    assert req.num_output_tokens == 3 and req.num_tokens == 10
    assert req.status.finish_reason == "length"


def test_finish_requests_from_outside() -> None:
    """finish_requests ends waiting and running requests, frees their blocks, reports them once,
    and ignores unknown or already-finished ids."""
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 20, 50), make_request("b", 20, 50)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.status.finish_reason == b.status.finish_reason == "abort"
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == ["a", "b"] and out.is_empty
    assert sched.kv.pool.num_free == sched.kv.num_blocks
    assert sched.schedule().finished_req_ids == []


def test_duplicate_request_id_is_refused() -> None:
    """A request id in use cannot be added again."""
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, 2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5, 2))


# ---- import hygiene -------------------------------------------------------------------------
def test_scheduler_import_does_not_pull_in_torch() -> None:
    """core/ is pure Python: importing the scheduler must not import torch."""
    code = "import sys, chunkserve.core.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


ALLOWED = ("chunkserve.core", "chunkserve.config", "chunkserve.sampling_params")


def test_scheduler_takes_only_a_resolved_config() -> None:
    """Defaults are decided in one place (SchedulerConfig.resolve); the scheduler asserts."""
    with pytest.raises(AssertionError, match="resolved"):
        Scheduler(SchedulerConfig(), CacheConfig(), 64)
    resolved = SchedulerConfig(max_model_len=512).resolve()
    assert resolved.is_resolved and resolved.resolve() == resolved


def test_core_imports_only_core_config_and_sampling_params() -> None:
    """core/ modules import nothing from chunkserve beyond core/, config and sampling_params."""
    core_dir = pathlib.Path(chunkserve.core.__file__).parent
    files = sorted(core_dir.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: only within core/ (or to the allowed leaves)
                    if node.level == 1:
                        continue
                    base = ".".join(["chunkserve", *filter(None, [node.module])])
                    names = [base] if node.module else [f"chunkserve.{a.name}" for a in node.names]
                else:
                    names = [node.module or ""]
            else:
                continue
            for name in names:
                if name == "chunkserve" or name.startswith("chunkserve."):
                    assert any(name == a or name.startswith(a + ".") for a in ALLOWED), (
                        f"{path.name} imports {name}"
                    )
