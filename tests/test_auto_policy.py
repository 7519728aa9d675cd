"""The default chunk policy of issue 28: adaptive toward a token-gap target on the engine's own
step-time model, unless a budget is given.

- Planning: with a known step-time model the planned chunk keeps the predicted step under the
  target, decodes first, over many decodes and long contexts; too slow a machine degrades to
  the smallest chunk with one warning; a target no step can meet is refused.
- Defaults: `serve` without flags is adaptive on the online model with the model's context as
  cap; an explicit budget (or no chunking, or offline `generate`) is static and unchanged.
- The engine: warm-started, its predictions in the trace; greedy output identical to static.
- Bad input on the command line: a clear one-line error, exit code 2.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import re

import pytest

from chunkserve.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_TARGET_ITL_MS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from chunkserve.core.chunk_budget import ChunkPlanner, PlannedStep, StepTimeFn
from chunkserve.core.request import RequestStatus
from chunkserve.core.scheduler import Scheduler
from chunkserve.sim.cost_model import (
    LINEAR_FEATURES,
    LinearCostModel,
    StepShape,
    planned_step_time,
    step_time,
)
from chunkserve.sim.online_model import OnlineCostModel
from tests.test_online_model import MACHINE  # a CPU-like machine, as a linear cost model
from tests.test_scheduler import assert_finished_by_length, fake_step, make_request

MS = 1e-3
STEP_TIME: StepTimeFn = planned_step_time(MACHINE)
PLANNER_LOG = "chunkserve.core.chunk_budget"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == PLANNER_LOG and r.levelno == logging.WARNING]


# ---- planning -------------------------------------------------------------------------------
@pytest.mark.parametrize("target_ms", [60.0, 250.0, 1000.0])
def test_planned_chunk_is_the_largest_under_the_target(target_ms: float,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Over 1..256 decodes at contexts up to 8k each and chunks after up to 8k cached tokens:
    the decodes are counted first, then the largest chunk whose step is predicted to fit."""
    target, floor, room = target_ms * MS, 32, 16384
    planner = ChunkPlanner(STEP_TIME, target, floor, explicit_target=True)
    over = 0
    for num_decodes, per_decode, prefill_context in itertools.product(
            [0, 1, 8, 64, 256], [16, 1024, 8192], [0, 1000, 8000]):
        decode_context = num_decodes * per_decode
        chunk = planner.prefill_tokens(num_decodes, decode_context, prefill_context, room)
        assert floor <= chunk <= room

        def predicted(n: int) -> float:
            return STEP_TIME(PlannedStep(num_decodes, decode_context, n, prefill_context))

        decodes_alone = STEP_TIME(PlannedStep(num_decodes, decode_context, 0, 0))
        if chunk > floor:
            assert predicted(chunk) <= target  # under the target ...
            assert decodes_alone < target
        else:  # ... or at the floor because nothing larger fits
            assert predicted(floor + 1) > target
        assert chunk == room or predicted(chunk + 1) > target  # ... and the largest that is
        over += decodes_alone > target
    # The warning comes once however many plans hit a decode batch above the target.
    assert len(warnings_of(caplog)) == (1 if over else 0)


def test_a_long_context_shrinks_the_chunk() -> None:
    planner = ChunkPlanner(STEP_TIME, 250 * MS, 32, explicit_target=True)
    chunks = [planner.prefill_tokens(16, 16 * 2000, context, 16384)
              for context in (0, 2000, 4000, 8000)]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1] > 32


def _adaptive_scheduler(target_ms: float | None, step_time: StepTimeFn = STEP_TIME,
                        max_model_len: int = 16384, floor: int = 32,
                        policy: str = "decode-first") -> Scheduler:
    config = SchedulerConfig(scheduler=policy, chunk_policy="adaptive", target_itl_ms=target_ms,
                             min_chunk_tokens=floor, step_time=step_time)
    return Scheduler(config.resolve(max_model_len), CacheConfig(), 16384)


@pytest.mark.parametrize("policy", ["decode-first", "vllm-v1"])
def test_scheduler_runs_decodes_first_and_holds_the_target(
        policy: str, caplog: pytest.LogCaptureFixture) -> None:
    """128 requests decoding at contexts of 1k-5k while two 8k prompts are prefilled: every
    decode runs every step, and each step's prefill is predicted (and, on the machine,
    measured) to fit the target."""
    target = 250 * MS
    sched = _adaptive_scheduler(target * 1e3, policy=policy)
    assert sched.config.max_num_batched_tokens == 16384  # adaptive: the cap is the context
    reqs = [make_request(f"d{i}", 1000 + 30 * i, 600) for i in range(128)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if all(r.is_decoding for r in reqs):
            break
        fake_step(sched)
    assert all(r.is_decoding for r in reqs)
    longs = [make_request(f"long{i}", 8000, 4) for i in range(2)]
    for r in longs:
        sched.add_request(r)
    chunks = 0
    while sched.has_unfinished_requests():
        decoding = {r.request_id for r in sched.running
                    if r.status is RequestStatus.RUNNING and r.is_decoding}
        out = fake_step(sched)
        decodes = [s for s in out.scheduled if s.is_decode]
        prefills = [s for s in out.scheduled if not s.is_decode]
        assert {s.request.request_id for s in decodes} == decoding  # nobody's token waits
        if not prefills:
            continue
        chunks += 1
        plan = PlannedStep(len(decodes), sum(s.start + 1 for s in decodes),
                           out.num_prefill_tokens, prefills[0].start)
        assert out.total_num_scheduled_tokens <= out.token_budget
        if out.num_prefill_tokens > 32:
            assert STEP_TIME(plan) <= target
            # The step as it ran (a chunk may finish one prompt and start the next).
            real = step_time(MACHINE, StepShape.from_scheduled(out.scheduled))
            assert real <= target + 1 * MS
    assert_finished_by_length(reqs + longs)
    assert chunks > 2 * 8000 / 1024  # the 8k prompts went in chunks smaller than 1024
    assert not warnings_of(caplog)  # 128 decodes fit 250 ms here


def test_decodes_above_the_target_degrade_to_the_floor_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """60 ms: one decode fits, 128 do not (~90 ms). Prefill then runs at the floor, and the
    log says so once, not every step."""
    sched = _adaptive_scheduler(60.0, max_model_len=4096)
    assert not warnings_of(caplog)  # one decode fits: nothing to say at start
    reqs = [make_request(f"d{i}", 16, 200) for i in range(128)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(100):  # until all are prefilled (2048 tokens) and decoding
        if all(r.is_decoding for r in reqs):
            break
        fake_step(sched)
    assert all(r.is_decoding for r in reqs)
    late = make_request("late", 1000, 2)
    sched.add_request(late)
    chunks = []
    while sched.has_unfinished_requests():
        out = fake_step(sched)
        chunks += [s.num_new_tokens for s in out.scheduled
                   if s.request is late and not s.is_decode]
    assert_finished_by_length(reqs + [late])
    assert chunks == [32] * 31 + [1000 - 31 * 32]  # decodes alone are above 60 ms: the floor
    (message,) = warnings_of(caplog)
    assert re.search(r"a decode-only step of \d+ request\(s\) is predicted to take", message)
    assert "above the token-gap target of 60.00 ms" in message
    assert "smallest chunk (32 tokens)" in message


def test_default_target_on_a_slow_machine_warns_once_and_runs_at_the_floor(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not the user's choice, so not an error: the default target below the machine's
    decode-only step is said once in the log; every chunk is the floor."""
    slow = planned_step_time(LinearCostModel({k: v * 100 for k, v in
                                              MACHINE.coefficients.items()}))
    assert slow(PlannedStep(1, 1, 0, 0)) > DEFAULT_TARGET_ITL_MS * MS
    sched = _adaptive_scheduler(None, step_time=slow, max_model_len=4096)
    assert len(warnings_of(caplog)) == 1
    req = make_request("p", 300, 3)
    sched.add_request(req)
    chunks = []
    while sched.has_unfinished_requests():
        out = fake_step(sched)
        chunks += [s.num_new_tokens for s in out.scheduled if not s.is_decode]
    assert chunks == [32] * 9 + [300 - 9 * 32]
    assert len(warnings_of(caplog)) == 1


def test_explicit_target_below_one_decode_is_refused() -> None:
    one_decode = STEP_TIME(PlannedStep(1, 1, 0, 0))
    with pytest.raises(ValueError, match=r"target_itl_ms 3 is below the predicted time of a "
                                         r"single decode step \(5\.\d\d ms\).*--target-itl-ms"):
        _adaptive_scheduler(3.0)
    _adaptive_scheduler(one_decode * 1e3 * 1.01)  # just above it is fine


@pytest.mark.parametrize("target_ms", [-5.0, 0.0, float("nan")])
def test_non_positive_target_is_refused(target_ms: float) -> None:
    with pytest.raises(ValueError, match=r"target_itl_ms \(--target-itl-ms\) must be positive"):
        _adaptive_scheduler(target_ms)


# ---- defaults -------------------------------------------------------------------------------
def _cli(argv: list[str], serving: bool) -> argparse.Namespace:
    from chunkserve.cli import _with_step_time, build_parser

    return _with_step_time(build_parser().parse_args(argv), serving=serving)


def _scheduler_config(args: argparse.Namespace, max_len: int = 4096) -> SchedulerConfig:
    from chunkserve.engine.arg_utils import config_from_args

    return config_from_args(args).resolve(max_len).scheduler_config


def test_serve_without_flags_is_adaptive_on_the_online_model() -> None:
    args = _cli(["serve"], serving=True)
    assert args.chunk_policy == "adaptive"
    assert isinstance(args.step_time, OnlineCostModel)
    config = _scheduler_config(args)
    assert config.chunk_policy == "adaptive" and config.scheduler == "decode-first"
    assert config.max_num_batched_tokens == 4096  # the cap is the model's context
    assert config.target_itl_ms is None
    assert config.target_s == pytest.approx(DEFAULT_TARGET_ITL_MS * MS)
    assert config.step_time is args.step_time
    # A target alone, or another chunked scheduler, keeps it adaptive.
    assert _cli(["serve", "--target-itl-ms", "80"], serving=True).chunk_policy == "adaptive"
    assert _cli(["serve", "--scheduler", "vllm-v1"], serving=True).chunk_policy == "adaptive"


@pytest.mark.parametrize("argv", [
    ["serve", "--max-num-batched-tokens", "512"],
    ["serve", "--max-num-batched-tokens", "512", "--chunk-policy", "static"],
    ["serve", "--max-num-batched-tokens", "512", "--scheduler", "decode-first"],
])
def test_serve_with_a_budget_is_static_and_unchanged(argv: list[str]) -> None:
    args = _cli(argv, serving=True)
    assert args.chunk_policy == "static"
    assert getattr(args, "step_time", None) is None
    config = _scheduler_config(args)
    # Exactly the config an explicit static budget made before issue 28.
    assert config == SchedulerConfig(max_num_batched_tokens=512).resolve(4096)
    assert config.max_num_batched_tokens == 512 and config.chunk_policy == "static"
    assert config.step_time is None


@pytest.mark.parametrize("argv, serving, budget", [
    (["serve", "--no-enable-chunked-prefill"], True, 4096),
    (["serve", "--scheduler", "prefill-first"], True, 4096),
    (["serve", "--scheduler", "orca"], True, 4096),
    (["serve", "--chunk-policy", "static"], True, DEFAULT_MAX_NUM_BATCHED_TOKENS),
    (["generate", "--prompt", "hi"], False, DEFAULT_MAX_NUM_BATCHED_TOKENS),
    (["generate", "--prompt", "hi", "--max-num-batched-tokens", "64"], False, 64),
])
def test_no_chunking_or_offline_stays_static(argv: list[str], serving: bool,
                                             budget: int) -> None:
    args = _cli(argv, serving=serving)
    assert args.chunk_policy == "static"
    assert getattr(args, "step_time", None) is None
    config = _scheduler_config(args)
    assert config.chunk_policy == "static" and config.max_num_batched_tokens == budget


def test_generate_with_a_target_is_adaptive() -> None:
    args = _cli(["generate", "--prompt", "hi", "--target-itl-ms", "80"], serving=False)
    assert args.chunk_policy == "adaptive" and isinstance(args.step_time, OnlineCostModel)
    config = _scheduler_config(args)
    assert config.target_s == pytest.approx(0.080) and config.max_num_batched_tokens == 4096


def test_llm_offline_default_is_static(tiny_model_dir: str) -> None:
    from chunkserve import LLM

    static = LLM(model=tiny_model_dir, dtype="float32", max_model_len=256)
    assert static.engine.step_model is None
    assert static.engine.config.scheduler_config.chunk_policy == "static"
    static.engine.close()


# ---- the engine -----------------------------------------------------------------------------
def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[(7919 * (i + 1) + 104729 * j) % 40000 + 100 for j in range(n)]
            for i, n in enumerate(lengths)]


def test_adaptive_engine_is_warm_started_and_traces_its_model(tiny_model_dir: str,
                                                              tmp_path) -> None:
    from chunkserve import LLM, SamplingParams
    from chunkserve.engine.trace import read_trace

    trace = tmp_path / "steps.jsonl"
    llm = LLM(model=tiny_model_dir, dtype="float32", chunk_policy="adaptive",
              max_model_len=256, trace_file=str(trace))
    engine = llm.engine
    model = engine.step_model
    assert isinstance(model, OnlineCostModel)
    assert set(model.coefficients) == set(LINEAR_FEATURES)
    assert all(v >= 0 for v in model.coefficients.values())
    assert model(PlannedStep(1, 1, 0, 0)) > 0
    sc = engine.config.scheduler_config
    assert sc.max_num_batched_tokens == 256 and sc.target_itl_ms is None

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts([5, 150, 40]), params)
    engine.close()
    records = read_trace(str(trace))
    assert len(records) >= 24
    stepped = [r for r in records if r.num_tokens]
    assert all(r.predicted_duration is not None and r.predicted_duration > 0 for r in stepped)
    assert all(r.step_model_error is not None and r.step_model_error >= 0 for r in stepped)
    refits = [r.step_model_coefficients for r in records if r.step_model_coefficients]
    assert refits and set(refits[-1]) == set(LINEAR_FEATURES)
    assert all(r.token_budget is not None and r.num_tokens <= r.token_budget for r in records)


def test_adaptive_engine_starts_on_a_tiny_context(tiny_model_dir: str, tmp_path) -> None:
    from chunkserve import LLM

    LLM(model=tiny_model_dir, dtype="float32", max_model_len=4).engine.close()  # static: fine
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=4, chunk_policy="adaptive",
              step_time=OnlineCostModel(cache=str(tmp_path)))  # a cold cache: it probes
    assert llm.engine.step_model is not None
    llm.engine.close()


def test_greedy_output_is_identical_under_auto_and_static(tiny_model_dir: str, tmp_path) -> None:
    """Chunking changes when tokens are computed, never which: the auto policy (default
    target, and a target so tight every chunk is the floor) against static budgets."""
    from chunkserve import LLM, SamplingParams
    from chunkserve.engine.trace import read_trace
    from chunkserve.model.factory import load_model

    loaded = load_model(tiny_model_dir, "float32", max_model_len=512)
    prompts = _prompts([5, 140, 40, 300, 9, 77])
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(**kwargs: object) -> list[list[int]]:
        llm = LLM(loaded=loaded, model=loaded.path, dtype="float32", **kwargs)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.engine.close()
        return outs

    want = run(max_num_batched_tokens=16)
    assert run(max_num_batched_tokens=2048) == want

    auto = LLM(loaded=loaded, model=loaded.path, dtype="float32", chunk_policy="adaptive")
    assert isinstance(auto.engine.step_model, OnlineCostModel)
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, greedy)] == want
    auto.engine.close()

    # A target just above one decode: nothing but the floor fits. The steps are planned with
    # a known machine's cost model, which learns nothing, so that this machine's timing (a
    # tiny model's steps are far cheaper than that machine's) cannot widen the chunks.
    from chunkserve.sim.cost_model import planned_step_time
    from tests.test_online_model import MACHINE

    frozen = planned_step_time(MACHINE)
    one_decode = frozen(PlannedStep(1, 1, 0, 0))
    trace = tmp_path / "tight.jsonl"
    tight = run(chunk_policy="adaptive", target_itl_ms=one_decode * 1e3 * 1.05,
                min_chunk_tokens=8, step_time=frozen, trace_file=str(trace))
    assert tight == want
    records = read_trace(str(trace))
    prefill_steps = [r.num_prefill_tokens for r in records if r.num_prefill_tokens]
    assert max(prefill_steps) <= 8  # the floor, every step
    assert sum(prefill_steps) == sum(len(p) for p in prompts)


# ---- bad input on the command line ----------------------------------------------------------
def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("chunkserve: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--target-itl-ms", "-5"], "target_itl_ms (--target-itl-ms) must be positive, got -5"),
    (["--target-itl-ms", "0"], "must be positive"),
    (["--chunk-policy", "adaptive", "--target-itl-ms", "0.001"],
     "is below the predicted time of a single decode step"),
    (["--chunk-policy", "static", "--target-itl-ms", "50"], "needs chunk_policy 'adaptive'"),
])
def test_bad_target_is_a_clear_error(tiny_model_dir: str, capsys: pytest.CaptureFixture[str],
                                     flags: list[str], message: str) -> None:
    from chunkserve.cli import main

    argv = ["generate", "--model", tiny_model_dir, "--dtype", "float32", "--max-model-len",
            "256", "--max-tokens", "2", "--prompt", "hi", *flags]
    assert main(argv) == 2
    assert message in _error_line(capsys)


def test_serve_refuses_a_negative_target_before_serving() -> None:
    """`serve` resolves the same config: the same error, before any port is opened (checked
    on the config, not by starting a server)."""
    args = _cli(["serve", "--target-itl-ms", "-5"], serving=True)
    assert args.chunk_policy == "adaptive"
    with pytest.raises(ValueError, match="must be positive, got -5"):
        _scheduler_config(args)
    args = _cli(["serve", "--no-enable-chunked-prefill", "--target-itl-ms", "50"], serving=True)
    with pytest.raises(ValueError, match="never chunks"):
        _scheduler_config(args)


def test_engine_config_from_kwargs_keeps_the_default_target() -> None:
    config = EngineConfig.from_kwargs(model="x", chunk_policy="adaptive", step_time=STEP_TIME)
    resolved = config.resolve(1024)
    assert resolved.scheduler_config.target_s == pytest.approx(DEFAULT_TARGET_ITL_MS * MS)
    assert resolved.scheduler_config.max_num_batched_tokens == 1024
