"""`chunkserve tune`: the search finds known optima on synthetic cost models, the command line
answers in text and JSON, bad input is a clear error, and --verify replays on the real engine."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from chunkserve.benchlib.args import length_requests
from chunkserve.cli import main
from chunkserve.sim.cost_model import StepShape
from chunkserve.sim.simulator import SimConfig, Workbench
from chunkserve.tune.search import search
from chunkserve.tune.slo import parse_slos
from chunkserve.tune.space import SearchSpace

MS = 1e-3


@dataclass
class SyntheticCost:
    """fixed + per_token·t + quadratic·t² a step: per-token cost is lowest at t = √(fixed/quad)."""

    fixed: float
    per_token: float
    quadratic: float = 0.0

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        t = shape.num_tokens
        return {"step": self.fixed if t else 0.0, "token": self.per_token * t,
                "quadratic": self.quadratic * t * t}


def bench(cost: SyntheticCost, prompt: int, output: int, n: int, gap_s: float) -> Workbench:
    return Workbench(SimConfig(max_model_len=8192, num_kv_blocks=4096), cost,
                     length_requests([prompt] * n, [output] * n),
                     [i * gap_s for i in range(n)], 1 / gap_s if gap_s else float("inf"))


def test_throughput_optimum_is_the_step_size_with_the_lowest_cost_per_token() -> None:
    # √(10 ms / (10 ms / 512²)) = 512: the budgets either side cost 25% more per token.
    cost = SyntheticCost(10 * MS, 0.01 * MS, 10 * MS / 512**2)
    result = search(bench(cost, 4000, 2, 16, 0.0), SearchSpace(), {}, "throughput")
    assert (result.pick.point.chunk_size, result.pick.point.scheduler) == (512, "decode-first")
    assert result.pick.point.chunk_policy == "static"
    others = [e for e in result.ladder if e.point.chunk_size in (256, 1024)]
    assert all(e.entry["output_throughput"] < 0.9 * result.pick.entry["output_throughput"]
               for e in others)


def test_itl_slo_bounds_the_budget_for_the_ttft_objective() -> None:
    """A decode's gap is the step it shares with a chunk: 5 + 0.1·budget ms, so an ITL p99 SLO
    of 60 ms allows budgets up to 550; TTFT falls with the budget: 512 is the optimum."""
    cost = SyntheticCost(5 * MS, 0.1 * MS)
    work = bench(cost, 2000, 40, 30, 0.25)
    slos = parse_slos(["itl_p99:60"])
    static_only = SearchSpace(vllm_v1=False, thresholds=False, adaptive=False)
    result = search(work, static_only, slos, "ttft")
    assert result.pick.point.chunk_size == 512
    assert result.pick.entry["p99_itl_ms"] <= 60
    # With the adaptive policy in the space the pick still meets the SLO, and TTFT is no worse.
    full = search(work, SearchSpace(), slos, "ttft")
    assert full.pick.entry["p99_itl_ms"] <= 60
    assert full.pick.entry["p99_ttft_ms"] <= result.pick.entry["p99_ttft_ms"]


@pytest.mark.parametrize("slo, message", [
    ("ttft_p98:100", "unknown key 'ttft_p98'"), ("latency:5", "unknown key"),
    ("itl_p99", "positive number"), ("itl_p99:abc", "positive number"),
    ("tpot_p99:-3", "positive number"),
])
def test_bad_slo_is_a_clear_error(slo: str, message: str, capsys) -> None:
    assert main(["tune", "--hardware", "a100-80gb", "--slo", slo]) == 2
    assert message in capsys.readouterr().err


def test_bad_objective_and_hardware_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "--hardware", "a100-80gb", "--objective", "latency"])
    assert main(["tune", "--hardware", "no-such-gpu", "--num-prompts", "4"]) == 2
    assert "no-such-gpu" in capsys.readouterr().err


def test_cli_answers_with_flags_runners_up_and_why(capsys) -> None:
    args = ["tune", "--hardware", "a100-80gb", "--model", "llama-3-8b", "--num-prompts", "60",
            "--slo", "itl_p99:60", "--slo", "ttft_p99:2000", "--chunk-sizes", "256,512,1024,2048"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["commands"]["chunkserve"].startswith("chunkserve serve llama-3-8b")
    assert d["commands"]["vllm"].startswith("vllm serve meta-llama/Meta-Llama-3-8B")
    assert d["runners_up"] and d["recommendation"]["meets_slos"] in (True, False)
    assert d["why"]["pick"]["cause"] and (d["why"]["below"] or d["why"]["above"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "why:" in text and "runners-up:" in text


def test_verify_replays_the_pick_and_two_neighbours_on_the_real_engine(tmp_path, capsys) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "kind": "linear", "name": "synthetic", "model": "tiny-llama", "dtype": "float32",
        "num_kv_blocks": 256, "coefficients": {"step": 0.002, "token": 0.00002}}))
    assert main(["tune", "--hardware", str(profile), "--model", "tiny-llama",
                 "--dataset-name", "random", "--random-input-len", "80", "--random-output-len",
                 "4", "--num-prompts", "4", "--request-rate", "50", "--chunk-sizes", "32,64,128",
                 "--verify", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)  # progress goes to stderr: stdout is the JSON
    assert len(d["verify"]) == 3
    for row in d["verify"]:
        assert row["metrics"]["output_throughput"]["measured"] > 0
        assert row["metrics"]["p99_ttft_ms"]["predicted"] > 0


def test_adaptive_targets_are_distinct_after_rounding() -> None:
    """Two rungs whose ITL p99 agree to 0.1 ms give one adaptive target, not two replays of it."""
    from chunkserve.tune.space import adaptive_targets

    assert adaptive_targets(256, {128: 22.71, 256: 22.74, 512: 40.0}, None) == [22.7, 40.0]
    assert adaptive_targets(256, {128: 22.71, 256: 22.74}, 50.0) == [22.7, 45.0]
