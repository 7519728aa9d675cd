"""The simulator: the real scheduler on a virtual clock, the cost model, calibration."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from chunkserve.benchlib.args import length_requests
from chunkserve.benchlib.sweep import SweepPoint, summarize
from chunkserve.benchlib.workloads import BenchRequest
from chunkserve.sim.fit import Sample, fit_linear
from chunkserve.sim.cost_model import (
    LINEAR_FEATURES,
    LinearCostModel,
    RooflineCostModel,
    StepShape,
    step_time,
)
from chunkserve.sim.simulator import SimConfig, sim_engine, simulate
from chunkserve.sim.specs import get_hardware, get_model, hardware_names, model_names


@pytest.fixture(scope="module")
def a100_8b() -> RooflineCostModel:
    return RooflineCostModel(get_hardware("a100-80gb"), get_model("llama-3-8b"))


# ---- the same engine loop ----------------------------------------------------------------------
def test_simulation_is_the_engine_loop_with_another_executor():
    """Structural: a simulation is an LLMEngine (no engine class of its own) whose executor is
    the cost model, replayed by the very loop `bench sweep` uses."""
    import chunkserve.bench.sweep as bench_sweep
    import chunkserve.sim.simulator as simulator
    from chunkserve.engine.clock import VirtualClock
    from chunkserve.engine.executor import Executor
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.sim.cost_executor import CostModelExecutor

    engine = sim_engine(SweepPoint(64, "decode-first"), SimConfig(256, 20), a100_cost(),
                        VirtualClock())
    assert type(engine) is LLMEngine and isinstance(engine.executor, CostModelExecutor)
    assert all(hasattr(engine.executor, name) for name in Executor.__annotations__)
    assert simulator.replay is bench_sweep.replay
    assert not hasattr(simulator, "SimEngine")


@pytest.mark.parametrize("scheduler,budget", [("decode-first", 48), ("vllm-v1", 32),
                                              ("prefill-first", None)])
def test_simulator_schedules_exactly_like_the_engine(tiny_model_dir, scheduler, budget):
    """Behavioural: the real model and the cost model, same requests, same steps."""
    from chunkserve.engine.clock import VirtualClock
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.sampling_params import SamplingParams

    lengths = [(70, 6), (15, 9), (130, 4), (33, 7), (90, 5)]
    point = SweepPoint(budget, scheduler)
    engine = LLMEngine.from_kwargs(model=tiny_model_dir, dtype="float32", max_model_len=256,
                                   num_kv_blocks=20, **point.engine_kwargs())
    sim = sim_engine(point, SimConfig(max_model_len=256, num_kv_blocks=20), a100_cost(),
                     VirtualClock())
    for i, (n_in, n_out) in enumerate(lengths):
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", [100 + j for j in range(n_in)], params, arrival_time=0.0)
        sim.add_request(f"r{i}", [0] * n_in, params, arrival_time=0.0)

    real_log = schedule_log(engine)
    assert schedule_log(sim) == real_log
    assert engine.scheduler.num_preemptions == sim.scheduler.num_preemptions


def schedule_log(e: LLMEngine) -> list[list[tuple[str, int]]]:
    """What each step scheduled, (request id, tokens), until every request is done."""
    log = []
    while e.has_unfinished_requests():
        step = e.step()
        log.append([(s.request.request_id, s.num_new_tokens) for s in step.scheduled])
    return log


def a100_cost() -> RooflineCostModel:
    return RooflineCostModel(get_hardware("a100-80gb"), get_model("llama-3-8b"))


# ---- cost model ---------------------------------------------------------------------------------
def test_cost_is_monotone_in_tokens_and_context(a100_8b):
    prefill = [step_time(a100_8b, StepShape(prefill=[(n, 0)], num_sampled=1))
               for n in (64, 256, 1024, 4096)]
    assert prefill == sorted(prefill) and len(set(prefill)) == 4
    cached = [step_time(a100_8b, StepShape(prefill=[(512, c)], num_sampled=1))
              for c in (0, 1024, 4096)]
    assert cached == sorted(cached) and len(set(cached)) == 3
    decode = [step_time(a100_8b, StepShape(decode_contexts=[ctx] * 32, num_sampled=32))
              for ctx in (128, 1024, 8000)]
    assert decode == sorted(decode) and len(set(decode)) == 3


def test_article_magnitudes(a100_8b):
    """background.md: a 4096-token prefill ~200-400 ms, a decode step ~5-15 ms (A100, 8B)."""
    prefill = step_time(a100_8b, StepShape(prefill=[(4096, 0)], num_sampled=1))
    decode = step_time(a100_8b, StepShape(decode_contexts=[1024] * 32, num_sampled=32))
    assert 0.2 <= prefill <= 0.4
    assert 0.005 <= decode <= 0.015


def test_tile_quantization_steps_at_the_tile_boundary(a100_8b):
    linear = {t: a100_8b.breakdown(StepShape(prefill=[(t, 0)]))["linear"]
              for t in (1023, 1024, 1025, 1152)}
    assert linear[1023] == linear[1024] < linear[1025] == linear[1152]


def test_mixed_penalty_only_for_mixed_steps(a100_8b):
    prefill_only = StepShape(prefill=[(512, 0)], num_sampled=1)
    decode_only = StepShape(decode_contexts=[1024] * 16, num_sampled=16)
    mixed = StepShape(prefill=[(512, 0)], decode_contexts=[1024] * 16, num_sampled=17)
    assert a100_8b.breakdown(prefill_only)["mixed_penalty"] == 0.0
    assert a100_8b.breakdown(decode_only)["mixed_penalty"] == 0.0
    assert a100_8b.breakdown(mixed)["mixed_penalty"] > 0.0
    split = RooflineCostModel(a100_8b.hw, a100_8b.model, attention_backend="split")
    pod = RooflineCostModel(a100_8b.hw, a100_8b.model, attention_backend="pod")
    assert split.breakdown(mixed)["mixed_penalty"] == 0.0
    assert step_time(pod, mixed) < step_time(split, mixed) < step_time(a100_8b, mixed)


def test_kv_capacity_llama3_8b_on_a100_80gb(a100_8b):
    # By hand: per layer q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 + mlp 3*4096*14336
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336  # 218,103,808
    weights = (32 * layer + 2 * 128256 * 4096) * 2  # + embedding and untied head, bf16 bytes
    free = 80 * 2**30 * 0.9 - weights - 2 * 2**30  # 90% of memory, minus activations
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert layer == 218_103_808 and kv_per_token == 131_072
    assert a100_8b.kv_cache_blocks(16) == int(free // (kv_per_token * 16))


def test_fp8_kv_cache_doubles_capacity_and_halves_decode_reads(tmp_path):
    """`sim --kv-cache-dtype fp8` on a preset: one byte a K/V value. The pool holds twice the
    tokens (the weights take the same memory) and a decode-only step's attention, bound by
    reading K/V, takes half the time; a calibrated profile refuses it."""
    import argparse

    from chunkserve.sim.cli import build_cost_model

    def build(kv: str, hardware: str = "a100-80gb"):  # type: ignore[no-untyped-def]
        return build_cost_model(argparse.Namespace(
            hardware=hardware, model="llama-3-8b", tensor_parallel_size=1,
            attention_backend="fused", max_model_len=None, num_kv_blocks=None, block_size=16,
            kv_cache_dtype=kv))

    (bf16, bf16_blocks, _), (fp8, fp8_blocks, _) = build("auto"), build("fp8")
    assert fp8.model.kv_bytes_per_token * 2 == bf16.model.kv_bytes_per_token
    assert fp8_blocks == 2 * bf16_blocks or fp8_blocks == 2 * bf16_blocks + 1
    decodes = StepShape(decode_contexts=[2048] * 64, num_sampled=64)
    assert fp8.breakdown(decodes)["attention"] == pytest.approx(
        bf16.breakdown(decodes)["attention"] / 2)
    # bfloat16: 2 bytes a value, said explicitly; a preset's bf16 model has that under auto
    # already, so the same pool.
    same, same_blocks, _ = build("bfloat16")
    assert same.model.kv_dtype_bytes == 2 and bf16.model.kv_dtype_bytes is None
    assert same.model.kv_bytes_per_token == bf16.model.kv_bytes_per_token
    assert same_blocks == bf16_blocks
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    with pytest.raises(ValueError, match="applies to hardware presets"):
        build("fp8", str(profile))


def test_tensor_parallel_shards_and_communicates():
    hw, model = get_hardware("h100-sxm"), get_model("llama-3-70b")
    with pytest.raises(ValueError, match="does not fit"):
        RooflineCostModel(hw, model, 1).kv_cache_blocks(16)
    tp4 = RooflineCostModel(hw, model, 4)
    tp8 = RooflineCostModel(hw, model, 8)
    shape = StepShape(prefill=[(2048, 0)], num_sampled=1)
    assert tp4.breakdown(shape)["communication"] > 0
    assert step_time(tp8, shape) < step_time(tp4, shape)
    assert tp8.kv_cache_blocks(16) > tp4.kv_cache_blocks(16) > 0


def test_presets_load():
    assert {"a100-80gb", "a100-40gb", "h100-sxm", "h200", "l4", "a6000"} <= set(hardware_names())
    assert {"llama-3-8b", "llama-3-70b", "llama-2-13b", "mistral-7b", "smollm2-135m"} <= set(
        model_names())
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu-v9")


def test_model_from_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    }))
    spec = get_model(str(tmp_path))
    assert spec.num_key_value_heads == 2 and spec.dim == 16


# ---- calibration --------------------------------------------------------------------------------
def test_calibration_recovers_known_coefficients():
    truth = {"step": 0.020, "request": 0.0004, "token": 0.0006, "small_gemm": 0.0003,
             "prefill_attention": 2e-8, "chunk_attention": 3e-8,
             "decode_context": 1.5e-6, "sampled": 0.0005, "mixed": 3e-7}
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(300):
        kind = rng.integers(3)
        cached = int(rng.integers(0, 3000)) if rng.random() < 0.5 else 0  # whole or a chunk
        prefill = [(int(rng.integers(16, 2048)), cached)] if kind != 1 else []
        decodes = [int(c) for c in rng.integers(64, 2048, size=rng.integers(1, 64))] if kind else []
        shape = StepShape(prefill, decodes, len(decodes) + int(rng.random() < 0.5) * len(prefill))
        samples.append(Sample("x", shape, step_time(LinearCostModel(truth), shape)))
    fitted = fit_linear(samples)
    for k in LINEAR_FEATURES:
        assert fitted[k] == pytest.approx(truth[k], rel=0.02), k


def test_replays_load_the_weights_format_the_profile_timed(tiny_model_dir):
    """An int8 profile computes in float32: its replays must load int8 weights, not dense
    float32 ones (a dense replay ran ~2x slower per decode step than the profile predicted)."""
    from chunkserve.bench.calibration import load_profiled_model

    prof = {"model": tiny_model_dir, "dtype": "float32"}
    assert load_profiled_model({**prof, "quantization": "int8"}).model.quantization == "int8"
    assert load_profiled_model({**prof, "quantization": "none"}).model.quantization is None
    assert load_profiled_model(prof).model.quantization is None  # written before it was recorded


# ---- simulations -----------------------------------------------------------------------------
def _long_and_short(n_short: int = 20) -> tuple[list[BenchRequest], list[float]]:
    # Short requests are decoding when one 4096-token prompt arrives.
    requests = length_requests([32] * n_short + [4096], [2] * n_short + [2])
    return requests, [0.0] * n_short + [0.001]


def test_no_chunk_tpot_p99_is_the_long_prefill_step(a100_8b):
    requests, arrivals = _long_and_short()
    config = SimConfig(max_model_len=8192, num_kv_blocks=4000)
    base = summarize(simulate(SweepPoint(None, "prefill-first"), config, a100_8b, requests,
                              arrivals), [99], None)
    chunked = summarize(simulate(SweepPoint(512, "decode-first"), config, a100_8b, requests,
                                 arrivals), [99], None)
    long_step = step_time(a100_8b, StepShape(prefill=[(4096, 0)], num_sampled=1))
    assert base["p99_tpot_ms"] == pytest.approx(long_step * 1000, rel=0.1)
    assert chunked["p99_tpot_ms"] * 5 < base["p99_tpot_ms"]


def test_simulation_is_deterministic(tmp_path):
    def run(out: str) -> list:
        r = subprocess.run(
            [sys.executable, "-m", "chunkserve.cli", "sim", "--hardware", "a100-80gb",
             "--model", "llama-3-8b", "--dataset-name", "mixed", "--num-prompts", "300",
             "--request-rate", "4", "--chunk-sizes", "none,512", "--seed", "3", "--out", out],
            capture_output=True, text=True, timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return json.loads((tmp_path / out / "results.json").read_text())

    first = run(str(tmp_path / "a"))
    assert first == run(str(tmp_path / "b"))
    assert [e["chunk_size"] for e in first] == ["none", 512]
    assert all(e["simulated"] and e["completed"] == 300 for e in first)
    for png in ("latency_vs_chunk.png", "tpot_cdf.png", "step_timeline.png"):
        assert (tmp_path / "a" / png).exists()


# ---- validation against the real engine ------------------------------------------------------------
def test_pool_concatenates_requests_and_sums_durations():
    from chunkserve.benchlib.metrics import RequestResult
    from chunkserve.bench.sweep import RunResult
    from chunkserve.sim.validate import pool

    point = SweepPoint(16, "decode-first")
    runs = [RunResult(point, [RequestResult(True, 4, 2, 0.1 * i)], [], 2.0) for i in (1, 2, 3)]
    pooled = pool(runs)
    assert [r.ttft for r in pooled.results] == [0.1, 0.2, 0.30000000000000004]
    assert pooled.duration == 6.0 and pooled.point is point


def test_step_cost_summary():
    from chunkserve.sim.validate import StepCosts

    costs = StepCosts(measured=[0.10, 0.20, 0.40], predicted=[0.11, 0.18, 0.40])
    s = costs.summary()
    assert s["busy_time_error"] == pytest.approx((0.69 - 0.70) / 0.70)
    assert s["median_abs_step_error"] == pytest.approx(0.10)
    assert s["num_steps"] == 3
    assert StepCosts().summary() == {}


def test_held_out_model_and_speed_factor():
    # Two configurations timed on one known machine, the second during a 10% slower spell.
    from chunkserve.sim.validate import RealRun, held_out_model, run_costs, speed_factor

    truth = LinearCostModel({"step": 0.015, "token": 3e-4, "decode_context": 4e-6,
                             "chunk_attention": 5e-7})
    rng = np.random.default_rng(1)

    def steps(slowdown: float) -> list:
        out = []
        for _ in range(200):
            shape = StepShape([(int(rng.integers(1, 512)), int(rng.integers(0, 3000)))],
                              [int(c) for c in rng.integers(16, 2048, size=rng.integers(0, 8))])
            out.append((shape, slowdown * step_time(truth, shape)))
        return out

    a, b = SweepPoint(256, "decode-first"), SweepPoint(None, "prefill-first")
    runs = [RealRun(p, 0, [8], [2], [0.0], [], 1.0, steps(f)) for p, f in ((a, 1.0), (b, 1.1))]
    # The model for `a` is fitted on `b` only: the truth at b's speed.
    model_a = held_out_model(runs, a)
    assert model_a.coefficients["step"] == pytest.approx(0.015 * 1.1, rel=1e-6)
    assert speed_factor(model_a, runs[0].steps) == pytest.approx(1 / 1.1)
    # Speed-matched, each run is priced at its own speed again.
    matched = run_costs(runs, "held_out_speed", truth)
    for run, cost in zip(runs, matched):
        assert speed_factor(cost, run.steps) == pytest.approx(1.0)
    assert run_costs(runs, "profile", truth) == [truth, truth]


def _validate_args(tmp_path, profile: str, *extra: str) -> list[str]:
    return ["sim", "--validate", "--hardware", profile,
            "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "4",
            "--num-prompts", "3", "--request-rate", "50", "--chunk-sizes", "none,16",
            "--out", str(tmp_path / "val"), *extra]


def _validate(tmp_path, profile: str, *extra: str) -> subprocess.CompletedProcess:
    """`chunkserve sim --validate` as a user runs it: its own process (the real engine runs)."""
    return subprocess.run(
        [sys.executable, "-m", "chunkserve.cli", *_validate_args(tmp_path, profile, *extra)],
        capture_output=True, text=True, timeout=300,
    )


def _validate_here(capsys, tmp_path, profile: str, *extra: str) -> subprocess.CompletedProcess:
    """The same command in this process, for what runs no engine (bad input, saved runs): no
    interpreter start and imports of its own. An exception the command line does not turn
    into its one-line error (a traceback, as a process) fails the test where it is raised."""
    from chunkserve.cli import main

    capsys.readouterr()  # only this command's output
    args = _validate_args(tmp_path, profile, *extra)
    code = main(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_validate_runs_engine_and_simulator_on_the_same_workloads(tmp_path, tiny_model_dir,
                                                                   capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "kind": "linear", "name": "test", "model": tiny_model_dir, "dtype": "float32",
        "num_kv_blocks": 64,
        "coefficients": {"step": 2e-3, "token": 1e-5, "decode_context": 1e-7},
    }))
    r = _validate(tmp_path, str(profile), "--repeats", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("repeat ") == 4  # 2 repeats x 2 chunk sizes, interleaved
    report = json.loads((tmp_path / "val" / "validation.json").read_text())
    assert list(report["calibrations"]) == ["profile", "held_out", "held_out_speed"]
    rows = report["calibrations"]["profile"]
    assert [row["chunk_size"] for row in rows] == ["none", 16]
    for row in rows:
        assert row["repeats"] == 2 and row["num_requests"] == 6
        assert set(row["relative_error"]) == set(row["real"]) == set(row["sim"])
        sim_ttft = row["sim"]["median_ttft_ms"]
        assert row["relative_error"]["median_ttft_ms"] == pytest.approx(
            (sim_ttft - row["real"]["median_ttft_ms"]) / row["real"]["median_ttft_ms"])
        # Every real step was also priced by the cost model.
        assert row["step_cost"]["num_steps"] > 0
        assert np.isfinite(row["step_cost"]["busy_time_error"])
    # Speed-matched: each run's predicted busy time equals its measured one.
    for row in report["calibrations"]["held_out_speed"]:
        assert row["step_cost"]["busy_time_error"] == pytest.approx(0.0, abs=1e-9)
    assert [(r["seed"], r["chunk_size"]) for r in report["runs"]] == [
        (0, "none"), (0, 16), (1, "none"), (1, 16)]
    md = (tmp_path / "val" / "validation.md").read_text()
    assert "**held_out**" in md and "cells within 10%" in md and "Machine speed per run" in md

    # The saved real runs score another profile without running the engine again: the real
    # side is unchanged, the simulated side follows the new coefficients.
    runs = tmp_path / "val" / "real_runs.json.gz"
    assert runs.exists()
    again = tmp_path / "again"
    r = _validate_here(capsys, again, str(profile), "--real-runs", str(runs))
    assert r.returncode == 0, r.stderr
    assert "repeat " not in r.stdout
    assert json.loads((again / "val" / "validation.json").read_text()) == report
    slower = tmp_path / "slower.json"
    slower.write_text(profile.read_text().replace('"step": 0.002', '"step": 0.02'))
    r = _validate_here(capsys, again, str(slower), "--real-runs", str(runs))
    assert r.returncode == 0, r.stderr
    rescored = json.loads((again / "val" / "validation.json").read_text())
    for old, new in zip(rows, rescored["calibrations"]["profile"]):
        assert new["real"] == old["real"]
        assert new["sim"]["median_tpot_ms"] > old["sim"]["median_tpot_ms"]
    # The held-out calibrations never read the profile's coefficients.
    assert rescored["calibrations"]["held_out"] == report["calibrations"]["held_out"]

    # Several files of saved runs pool into one report (more requests behind each percentile)...
    r = _validate_here(capsys, again, str(profile), "--real-runs", str(runs), str(runs))
    assert r.returncode == 0, r.stderr
    pooled = json.loads((again / "val" / "validation.json").read_text())
    assert [row["num_requests"] for row in pooled["calibrations"]["profile"]] == [12, 12]
    # ...but only runs of one engine configuration.
    with gzip.open(runs, "rt") as f:
        data = json.load(f)
    data["num_kv_blocks"] += 1
    other = tmp_path / "other.json.gz"
    with gzip.open(other, "wt") as f:
        json.dump(data, f)
    r = _validate_here(capsys, again, str(profile), "--real-runs", str(runs), str(other))
    assert r.returncode == 2 and "different num_kv_blocks" in r.stderr


def test_validate_rejects_bad_input(tmp_path, capsys):
    r = _validate_here(capsys, tmp_path, "a100-80gb")
    assert r.returncode == 2 and "profile file" in r.stderr and "Traceback" not in r.stderr
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"kind": "linear", "coefficients": {}, "name": "x",
                                   "model": "smollm2-135m", "dtype": "float32",
                                   "num_kv_blocks": 8}))
    r = _validate_here(capsys, tmp_path, str(profile), "--repeats", "0")
    assert r.returncode == 2 and "--repeats" in r.stderr
    (tmp_path / "junk.json.gz").write_text("not gzip")
    r = _validate_here(capsys, tmp_path, str(profile), "--real-runs",
                       str(tmp_path / "junk.json.gz"))
    assert r.returncode == 2 and "not a file of real runs" in r.stderr
    assert "Traceback" not in r.stderr
    with gzip.open(tmp_path / "empty.json.gz", "wt") as f:
        json.dump({"runs": []}, f)
    r = _validate_here(capsys, tmp_path, str(profile), "--real-runs",
                       str(tmp_path / "empty.json.gz"))
    assert r.returncode == 2 and "missing max_model_len" in r.stderr


def test_family_weights_decide_which_family_the_fit_follows():
    # Two families that disagree by 2x on the per-token cost: the fit follows the weighted one.
    live = [Sample("workload", StepShape(prefill=[(n, 0)]), 0.01 + 1e-4 * n) for n in (8, 64, 256)]
    grid = [Sample("prefill", StepShape(prefill=[(n, 0)]), 0.01 + 2e-4 * n) for n in (16, 128, 512)]
    weighted = fit_linear(live + grid, {"prefill": 1e-4})
    model = LinearCostModel(weighted)
    for n in (8, 64, 256):
        assert step_time(model, StepShape(prefill=[(n, 0)])) == pytest.approx(0.01 + 1e-4 * n,
                                                                               rel=0.02)


@pytest.mark.parametrize("name,billions", [("qwen2.5-7b", 7.61), ("qwen3-8b", 8.19),
                                           ("phi-3-mini", 3.82)])
def test_new_architecture_presets_have_their_model_cards_size(name, billions):
    """The simulator's shape of each preset: parameter counts as the model cards state them
    (biases and norms are below the rounding), and the same linears as the checkpoint the
    engine would load for it."""
    from math import prod

    from chunkserve.model.models.checkpoint import expected_shapes
    from chunkserve.model.models.registry import config_from_hf
    from chunkserve.presets import model_preset

    spec = get_model(name)
    assert spec.weight_bytes / spec.dtype_bytes / 1e9 == pytest.approx(billions, rel=0.01)
    shapes = expected_shapes(config_from_hf(model_preset(name)))
    layer = [s for n, s in shapes.items() if n.startswith("model.layers.0.") and len(s) == 2]
    assert spec.layer_params == sum(prod(s) for s in layer)
    model = RooflineCostModel(get_hardware("h100-sxm"), spec)
    assert model.kv_cache_blocks(16) > 0
    assert step_time(model, StepShape(prefill=[(512, 0)], decode_contexts=[1024] * 8,
                                     num_sampled=9)) > 0
