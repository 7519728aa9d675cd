"""`auto` everywhere (issue 28): the --chunk-sizes entry in `bench sweep` and `sim`, tune's
comparison with its pick, and the load that steps (`--load 0.4,0.9`)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from chunkserve.benchlib.args import (
    add_sweep_args,
    check_sweep_args,
    length_requests,
    points_from_args,
    rate_json,
)
from chunkserve.benchlib.sweep import (
    SweepPoint,
    chunk_size_from_json,
    parse_chunk_sizes,
    sweep_point,
)
from chunkserve.benchlib.workloads import arrival_times, sample_lengths, stepped_arrival_times
from chunkserve.cli import main
from chunkserve.config import DEFAULT_TARGET_ITL_MS
from chunkserve.sim.cost_model import RooflineCostModel
from chunkserve.sim.simulator import SimConfig, simulate
from chunkserve.sim.specs import get_hardware, get_model


def sweep_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_sweep_args(p)
    return p.parse_args([*argv, "--out", "unused"])


# ---- the --chunk-sizes entry ------------------------------------------------------------------
def test_auto_parses_and_is_the_adaptive_policy_capped_by_the_context() -> None:
    assert parse_chunk_sizes("auto, none,64") == ["auto", None, 64]
    auto, none, static = points_from_args(sweep_args("--chunk-sizes", "auto,none,64"))
    assert (auto.auto, auto.adaptive, auto.chunk_size, auto.target_itl_ms) == (True, True, None,
                                                                               None)
    assert auto.engine_kwargs()["max_num_batched_tokens"] is None  # resolve: max_model_len
    assert auto.label == "auto" and auto.target_ms == DEFAULT_TARGET_ITL_MS
    assert auto.policy_keys()["target_itl_ms"] == DEFAULT_TARGET_ITL_MS
    assert none == SweepPoint(None, "prefill-first") and none.no_chunk and not none.auto
    assert static.chunk_policy == "static" and static.label == 64 and not static.no_chunk
    assert chunk_size_from_json("auto") == "auto" and chunk_size_from_json("none") is None
    with pytest.raises(ValueError, match="'auto', 'none' or a positive integer"):
        parse_chunk_sizes("auto,automatic")


def test_target_alone_sets_auto_and_adaptive_sweeps_keep_their_caps() -> None:
    args = sweep_args("--chunk-sizes", "auto,64", "--target-itl-ms", "80")
    check_sweep_args(args)
    auto, static = points_from_args(args)
    assert auto.target_itl_ms == 80 and static == sweep_point(64, "decode-first", "prefill-first")
    with pytest.raises(ValueError, match="go together"):
        check_sweep_args(sweep_args("--chunk-sizes", "64", "--target-itl-ms", "80"))
    args = sweep_args("--chunk-sizes", "auto,none,64", "--chunk-policy", "adaptive",
                      "--target-itl-ms", "80")
    check_sweep_args(args)
    auto, none, capped = points_from_args(args)
    assert capped == SweepPoint(64, "decode-first", "adaptive", 80.0) and not capped.auto
    assert auto.auto and auto.target_itl_ms == 80 and none.no_chunk


def test_simulated_auto_plans_each_step_under_the_target() -> None:
    """The simulator's cost model stands in for the online fit: prefill steps are sized to the
    target (budgets vary, far below the context), and no step exceeds it."""
    cost = RooflineCostModel(get_hardware("a100-80gb"), get_model("llama-3-8b"))
    input_lens, output_lens, _ = sample_lengths("mixed", 60, 0, output_range=(16, 64))
    arrivals = stepped_arrival_times(60, [4.0, 9.0], 1.0, 0)
    config = SimConfig(max_model_len=8192, num_kv_blocks=4000)
    for target in (40.0, None):
        point = sweep_point("auto", "decode-first", "prefill-first", None, target)
        run = simulate(point, config, cost, length_requests(input_lens, output_lens), arrivals)
        prefill = [r for r in run.records if r.num_prefill_tokens]
        assert len({r.token_budget for r in run.records}) > 1
        assert all(r.token_budget < 8192 for r in prefill)  # sized, not the cap
        limit = (target or DEFAULT_TARGET_ITL_MS) / 1e3
        assert max(r.duration for r in run.records) <= limit
        assert all(r.success for r in run.results)


def test_sim_cli_auto_and_a_stepped_load(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["sim", "--hardware", "a100-80gb", "--model", "llama-3-8b", "--num-prompts", "60",
                 "--load", "0.4,0.9", "--chunk-sizes", "auto,512,none", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [e["chunk_size"] for e in results] == ["auto", 512, "none"]
    auto = results[0]
    assert auto["chunk_policy"] == "adaptive" and auto["target_itl_ms"] == DEFAULT_TARGET_ITL_MS
    assert auto["max_itl_ms"] <= DEFAULT_TARGET_ITL_MS
    for e in results:
        assert e["load"] == [0.4, 0.9] and e["completed"] == 60
        low, high = e["request_rate"]
        assert high / low == pytest.approx(0.9 / 0.4)
    assert "| auto | decode-first |" in (out / "table.md").read_text()
    assert "simulated capacity" in capsys.readouterr().out


# ---- the load that steps ------------------------------------------------------------------------
def test_stepped_arrivals_change_rate_halfway() -> None:
    capacity = 5.0
    times = stepped_arrival_times(4000, [0.4 * capacity, 0.9 * capacity], 1.0, seed=0)
    gaps = np.diff(times)
    first, second = gaps[:1999], gaps[2000:]  # the gaps before requests 1..1999, 2001..3999
    assert first.mean() == pytest.approx(1 / (0.4 * capacity), rel=0.06)
    assert second.mean() == pytest.approx(1 / (0.9 * capacity), rel=0.06)
    # One rate draws exactly what arrival_times draws: a plain run's arrivals do not change.
    assert stepped_arrival_times(50, [3.0], 0.7, 3) == arrival_times(50, 3.0, 0.7, 3)
    # An infinite rate: that half arrives all at once when it begins.
    times = stepped_arrival_times(4, [1.0, float("inf")], 1.0, seed=0)
    assert times[1] > 0 and times[1] == times[2] == times[3]
    with pytest.raises(ValueError, match="request_rate must be positive"):
        stepped_arrival_times(4, [1.0, -1.0], 1.0, 0)


def test_rate_flags_take_one_value_or_steps() -> None:
    args = sweep_args("--load", "0.4,0.9")
    assert args.load == (0.4, 0.9) and args.request_rate is None
    assert sweep_args("--request-rate", "inf").request_rate == (float("inf"),)
    assert rate_json((float("inf"),)) == "inf" and rate_json(2.5) == 2.5
    assert rate_json((1.0, 2.0)) == [1.0, 2.0]
    with pytest.raises(ValueError, match="--load must be a positive fraction"):
        check_sweep_args(sweep_args("--load", "0.4,0"))
    with pytest.raises(SystemExit):
        sweep_args("--load", "0.4,high")


# ---- the real engine ------------------------------------------------------------------------------
def test_bench_sweep_runs_auto_on_a_fresh_online_model(tiny_model_dir, tmp_path,
                                                      monkeypatch) -> None:
    from chunkserve.sim import online_model

    made: list[online_model.OnlineCostModel] = []
    real_init = online_model.OnlineCostModel.__init__

    def init(self: online_model.OnlineCostModel, *a: object, **kw: object) -> None:
        made.append(self)
        real_init(self, *a, **kw)

    monkeypatch.setattr(online_model.OnlineCostModel, "__init__", init)
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--model", tiny_model_dir, "--dtype", "float32",
                 "--max-model-len", "512", "--num-prompts", "6", "--mixed-long-input-range",
                 "200:300", "--mixed-short-input-range", "16:48", "--mixed-output-range", "4:6",
                 "--mixed-long-fraction", "0.34", "--request-rate", "40,80", "--chunk-sizes",
                 "auto,64,auto", "--out", str(out), "--trace-dir", str(tmp_path / "tr")]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [e["chunk_size"] for e in results] == ["auto", 64, "auto"]
    assert all(e["completed"] == 6 and e["request_rate"] == [40.0, 80.0] for e in results)
    assert results[0]["chunk_policy"] == "adaptive" and "chunk_policy" not in results[1]
    assert len(made) == 2 and made[0] is not made[1]  # one fresh online model per auto run
    trace = [json.loads(line) for line in (tmp_path / "tr" / "steps-auto.jsonl").open()]
    assert trace and all(r["token_budget"] <= 512 for r in trace)  # the cap: the context
    assert "| auto | decode-first |" in (out / "table.md").read_text()
    assert (out / "latency_vs_chunk.png").read_bytes()[:4] == b"\x89PNG"


# ---- tune ---------------------------------------------------------------------------------------
def test_tune_reports_auto_beside_its_pick(capsys) -> None:
    args = ["tune", "--hardware", "a100-80gb", "--model", "llama-3-8b", "--num-prompts", "40",
            "--slo", "itl_p99:60", "--chunk-sizes", "256,1024,auto"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    auto = d["auto"]
    assert auto["kind"] == "auto" and auto["target_itl_ms"] == DEFAULT_TARGET_ITL_MS
    assert auto["command"] == "chunkserve serve llama-3-8b --max-num-seqs 256"
    assert set(auto["vs_pick"]) == {"p99_ttft_ms", "p99_itl_ms", "max_itl_ms", "request_goodput"}
    itl = auto["vs_pick"]["p99_itl_ms"]
    assert itl["pick"] == d["recommendation"]["p99_itl_ms"] and itl["auto"] == auto["p99_itl_ms"]
    assert auto["pick_meets_slos"] == d["recommendation"]["meets_slos"]
    assert isinstance(auto["meets_slos"], bool) and auto["max_itl_ms"] > 0
    assert all(c["kind"] != "auto" for c in d["all"])  # compared, not ranked
    assert d["workload"]["load"] == 0.7
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "auto, the default (no chunking flag), against the pick:" in text
    assert "vs the pick: TTFT p99" in text
