"""The simulator on sliding-window models (Gemma 3): presets, KV capacity by KV-cache group,
the scheduler freeing window blocks, the windowed attention cost, and models without windows
simulated exactly as before."""
from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from chunkserve.benchlib.args import length_requests
from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.core.kv_cache import NULL_BLOCK
from chunkserve.core.kv_groups import single_group
from chunkserve.engine.clock import VirtualClock
from chunkserve.sampling_params import SamplingParams
from chunkserve.sim.cli import add_sim_args, build_target, sim_workbench
from chunkserve.sim.cost_model import (
    LinearCostModel,
    RooflineCostModel,
    StepShape,
    linear_features,
    step_time,
)
from chunkserve.sim.simulator import SimConfig, sim_engine, simulate
from chunkserve.sim.specs import HardwareSpec, ModelSpec, get_hardware, get_model
from test_sim import schedule_log

W270, CHUNK = 512, 512


def full_attention(spec: ModelSpec) -> ModelSpec:
    """The same model with every layer attending the whole context (no window anywhere)."""
    return dataclasses.replace(spec, layer_windows=None)


def sim_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_sim_args(p)
    return p.parse_args(["--out", "unused", *flags])


# ---- presets -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layers,window,full,group_size,billions", [
    ("gemma-3-270m", 18, 512, 3, 3, 0.268),
    ("gemma-3-27b", 62, 1024, 10, 10, 27.0),
])
def test_gemma3_presets_carry_their_windows(name, layers, window, full, group_size, billions):
    spec = get_model(name)
    assert spec.num_hidden_layers == layers == len(spec.layer_windows)
    # Every 6th layer global, the rest local: what the config.json's layer_types list.
    assert [w is None for w in spec.layer_windows] == [(i + 1) % 6 == 0 for i in range(layers)]
    assert spec.attention_layers == ((None, full), (window, layers - full))
    assert spec.weight_bytes / spec.dtype_bytes / 1e9 == pytest.approx(billions, rel=0.01)
    groups = spec.kv_cache_groups(spec.max_position_embeddings)
    assert groups is not None and groups.group_size == group_size
    assert groups.windows[0] is None and set(groups.windows[1:]) == {window}
    # A context the window never slides within needs no groups (the engine's rule too).
    assert spec.kv_cache_groups(window) is None


def test_sim_windows_are_the_engines_layer_types():
    from chunkserve.layer_types import SLIDING, layer_types
    from chunkserve.presets import model_preset

    for name in ("gemma-3-270m", "gemma-3-27b"):
        engine = [t == SLIDING for t in layer_types(model_preset(name))]
        assert [w is not None for w in get_model(name).layer_windows] == engine


@pytest.mark.parametrize("name", ["llama-3-8b", "mistral-7b", "phi-3-mini", "qwen2.5-7b",
                                  "qwen3-8b", "smollm2-135m"])
def test_models_that_name_no_sliding_layers_stay_full_attention(name):
    # Mistral and Phi-3 name a window but not which layers slide: simulated as before.
    spec = get_model(name)
    assert spec.layer_windows is None and spec.attention_layers == ((None, spec.num_hidden_layers),)
    assert spec.kv_cache_groups(spec.max_position_embeddings) is None
    target = build_target(sim_args("--hardware", "h100-sxm", "--model", name))
    assert target.kv_cache_groups is None


# ---- KV capacity -------------------------------------------------------------------------------
def test_kv_blocks_are_group_size_layers():
    spec = get_model("gemma-3-27b")
    cost = RooflineCostModel(get_hardware("h200"), spec)
    groups = spec.kv_cache_groups(spec.max_position_embeddings)
    assert groups is not None
    # A block of 10 layers holds 62/10 times the blocks of all 62 layers (up to flooring).
    assert cost.kv_cache_blocks(16, groups) == pytest.approx(cost.kv_cache_blocks(16) * 6.2,
                                                             abs=7)
    windows = build_target(sim_args("--hardware", "h200", "--model", "gemma-3-27b"))
    assert windows.kv_cache_groups == groups
    assert windows.num_kv_blocks == cost.kv_cache_blocks(16, groups)
    one_table = build_target(sim_args("--hardware", "h200", "--model", "gemma-3-27b",
                                      "--disable-hybrid-kv-cache-manager"))
    assert one_table.kv_cache_groups is None
    assert one_table.num_kv_blocks == cost.kv_cache_blocks(16)
    bench = sim_workbench(sim_args("--hardware", "h200", "--model", "gemma-3-27b",
                                   "--num-prompts", "2"), log=lambda line: None)
    assert bench.config.kv_cache_groups == groups


def test_long_prompt_holds_bounded_window_blocks():
    """Gemma 3 270m, one 12,000-token prompt: the global group's table grows with the prompt,
    each local group's stays within its window (at most ⌈(W−1+chunk)/block⌉+1 blocks)."""
    spec = get_model("gemma-3-270m")
    groups = spec.kv_cache_groups(16384)
    assert groups is not None
    config = SimConfig(max_model_len=16384, num_kv_blocks=4000, kv_cache_groups=groups)
    cost = RooflineCostModel(get_hardware("l4"), spec)
    engine = sim_engine(SweepPoint(CHUNK, "decode-first"), config, cost, VirtualClock())
    engine.add_request("long", [1] + [0] * 11_999, SamplingParams(max_tokens=32, ignore_eos=True),
                       arrival_time=0.0)
    window_bound = -(-(W270 - 1 + CHUNK) // 16) + 1
    peak_local = peak_global = 0
    while engine.has_unfinished_requests():
        engine.step()
        tables = engine.scheduler.kv.tables.get("long")
        if tables is None:
            continue
        live = [sum(b != NULL_BLOCK for b in table) for table in tables]
        peak_global = max(peak_global, live[0])
        peak_local = max(peak_local, *live[1:])
    assert peak_global == math.ceil((12_000 + 32) / 16)
    assert 0 < peak_local <= window_bound < peak_global / 10
    # The request never held more than the bound the engine checks capacity with.
    assert peak_global + 5 * peak_local <= groups.blocks_per_token_bound(16, 12_032, CHUNK)


def test_windows_run_more_requests_on_the_same_memory():
    """Same GPU memory, same workload: the grouped KV cache (3-layer blocks, local layers
    freeing what leaves the window) runs more requests at once than the model forced to full
    attention (18-layer blocks, every token kept) or one block table for all layers."""
    spec = get_model("gemma-3-270m")
    full_blocks = 1500
    # A GPU whose memory holds the weights and `full_blocks` blocks of every layer.
    hw = HardwareSpec("small", peak_tflops=100, hbm_gbps=1000, gpu_memory_utilization=1.0,
                      activation_reserve_gib=0.0,
                      memory_gib=(spec.weight_bytes + full_blocks * 16 * spec.kv_bytes_per_token
                                  + 1) / 2**30)
    requests = length_requests([3000] * 24, [256] * 24)
    arrivals = [0.0] * len(requests)

    def run(model: ModelSpec, hybrid: bool) -> tuple[int, int, int]:
        cost = RooflineCostModel(hw, model)
        groups = model.kv_cache_groups(4096) if hybrid else None
        config = SimConfig(max_model_len=4096, num_kv_blocks=cost.kv_cache_blocks(16, groups),
                           kv_cache_groups=groups)
        result = simulate(SweepPoint(CHUNK, "decode-first"), config, cost, requests, arrivals)
        return (config.num_kv_blocks, max(r.num_running for r in result.records),
                sum(r.num_preemptions for r in result.records))

    blocks, running, preempted = run(spec, hybrid=True)
    full_blocks_, full_running, full_preempted = run(full_attention(spec), hybrid=True)
    one_blocks, one_running, one_preempted = run(spec, hybrid=False)
    assert full_blocks_ == one_blocks == full_blocks and blocks == 6 * full_blocks
    assert running == len(requests) and running > 2 * max(full_running, one_running)
    assert preempted == 0 < min(full_preempted, one_preempted)


# ---- attention cost ----------------------------------------------------------------------------
def test_windowed_pairs_integrate_the_capped_key_count():
    w = 1024
    for n, c in [(512, 0), (512, 256), (2048, 0), (512, 800), (512, 4000), (1, 5000)]:
        shape = StepShape(prefill=[(n, c)])
        # ∫_c^{c+n} min(x, W) dx, numerically
        steps = 100_000
        numeric = sum(min(c + (i + 0.5) * n / steps, w) for i in range(steps)) * n / steps
        assert shape.prefill_attention_work_within(w) == pytest.approx(numeric, rel=1e-6)
        if c + n <= w:
            assert shape.prefill_attention_work_within(w) == shape.prefill_attention_work
    decode = StepShape(decode_contexts=[100, 1024, 5000])
    assert decode.decode_context_within(w) == 100 + 1024 + 1024
    assert decode.decode_context_within(None) == decode.decode_context


def test_long_context_attention_costs_less_with_windows():
    spec = get_model("gemma-3-27b")
    hw = get_hardware("h200")
    windowed, full = RooflineCostModel(hw, spec), RooflineCostModel(hw, full_attention(spec))
    long_chunk = StepShape(prefill=[(2048, 30_000)], num_sampled=1)
    long_decodes = StepShape(decode_contexts=[32_000] * 32, num_sampled=32)
    for shape in (long_chunk, long_decodes):
        a, b = windowed.breakdown(shape), full.breakdown(shape)
        # 10 global layers over the whole context, 52 local ones over their 1024 keys.
        assert a["attention"] < 0.25 * b["attention"]
        assert a["linear"] == b["linear"] and a["lm_head"] == b["lm_head"]
    decode_ratio = (windowed.breakdown(long_decodes)["attention"]
                    / full.breakdown(long_decodes)["attention"])
    assert decode_ratio == pytest.approx((10 * 32_000 + 52 * 1024) / (62 * 32_000))
    short = StepShape(prefill=[(512, 0)], decode_contexts=[900] * 8, num_sampled=9)
    assert windowed.breakdown(short)["attention"] == pytest.approx(
        full.breakdown(short)["attention"])
    # The calibrated model's features: averaged over layers, lower with windows too.
    layers = spec.attention_layers
    assert linear_features(long_decodes, layers)["decode_context"] < linear_features(
        long_decodes)["decode_context"]
    calibrated = LinearCostModel({"decode_context": 1e-6, "chunk_attention": 1e-9}, "x", layers)
    assert step_time(calibrated, long_chunk) < step_time(
        LinearCostModel(calibrated.coefficients, "x"), long_chunk)


# ---- models without windows: the numbers of before --------------------------------------------
def _old_roofline_attention(cost: RooflineCostModel, shape: StepShape) -> float:
    """The attention term as it was computed before windows (fused backend, tp=1)."""
    hw, m = cost.hw, cost.model
    prefill = (4.0 * m.num_attention_heads * m.dim * shape.prefill_attention_work
               * m.num_hidden_layers / (hw.peak_flops * hw.attention_efficiency))
    decode = shape.decode_context * (m.kv_bytes_per_token / 1) / (
        hw.bandwidth * hw.bandwidth_efficiency)
    return prefill + decode


def test_models_without_windows_keep_their_numbers():
    spec = get_model("llama-3-8b")
    cost = RooflineCostModel(get_hardware("a100-80gb"), spec)
    for shape in (StepShape(prefill=[(2048, 3000)], num_sampled=1),
                  StepShape(decode_contexts=[7000, 123, 4096], num_sampled=3)):
        assert cost.breakdown(shape)["attention"] == _old_roofline_attention(cost, shape)
        assert linear_features(shape, None) == linear_features(shape)
    assert cost.kv_cache_blocks(16) == cost.kv_cache_blocks(16, single_group(32))
    # A one-group model simulated with groups=None or its explicit single group: same run.
    requests = length_requests([700, 40, 2500, 90] * 3, [30, 60, 8, 20] * 3)
    arrivals = [0.05 * i for i in range(len(requests))]
    point = SweepPoint(256, "decode-first")
    plain = simulate(point, SimConfig(4096, 400), cost, requests, arrivals)
    grouped = simulate(point, SimConfig(4096, 400, kv_cache_groups=single_group(32)), cost,
                       requests, arrivals)
    assert plain.duration == grouped.duration
    assert [r.num_running for r in plain.records] == [r.num_running for r in grouped.records]


# ---- the same schedule as the real engine ------------------------------------------------------
def test_simulator_schedules_a_windowed_model_like_the_engine(tmp_path):
    """A tiny random Gemma 3 (window 32: local, global, local layers) on the real engine and in
    the simulator, from the same config.json: the sim's groups are the engine's, so the two
    schedule the same steps, free the same window blocks and preempt alike (the pool is too
    small for the three requests at once)."""
    from arch_models import hf_model, save_hf_folder
    from chunkserve.engine.llm_engine import LLMEngine

    folder = save_hf_folder(hf_model("gemma3"), tmp_path / "gemma3")
    spec = get_model(str(folder))
    groups = spec.kv_cache_groups(128)
    point = SweepPoint(48, "decode-first")
    engine = LLMEngine.from_kwargs(model=str(folder), dtype="float32", max_model_len=128,
                                   num_kv_blocks=20, load_format="dummy",
                                   **point.engine_kwargs())
    assert groups is not None and engine.executor.kv_cache_groups == groups
    cost = RooflineCostModel(get_hardware("a100-80gb"), spec)
    sim = sim_engine(point, SimConfig(128, 20, kv_cache_groups=groups), cost, VirtualClock())
    one_table = sim_engine(point, SimConfig(128, 20), cost, VirtualClock())
    for i, (n_in, n_out) in enumerate([(100, 20), (80, 24), (64, 20)]):
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        for e in (engine, sim, one_table):
            e.add_request(f"r{i}", [100 + i] + [7] * (n_in - 1), params, arrival_time=0.0)

    real = schedule_log(engine)
    assert schedule_log(sim) == real
    assert sim.scheduler.num_preemptions == engine.scheduler.num_preemptions > 0
    # Without the groups the simulator would have scheduled another run.
    assert schedule_log(one_table) != real
