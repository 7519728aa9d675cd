"""`chunkserve tune`: the search finds known optima on synthetic cost models, the command line
answers in text and JSON, bad input is a clear error, and --verify replays on the real engine."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from chunkserve.benchlib.args import length_requests
from chunkserve.benchlib.sweep import SweepPoint
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


@pytest.mark.parametrize("margin, best", [(1.0, 512), (1.25, 256)])
def test_itl_slo_bounds_the_budget_for_the_ttft_objective(margin: float, best: int) -> None:
    """A decode's gap is the step it shares with a chunk: 5 + 0.1·budget ms, so an ITL p99 SLO
    of 60 ms allows budgets up to 550; TTFT falls with the budget: 512 is the optimum. On a
    machine 1.25x slower the gap is 1.25·(5 + 0.1·budget): 512 misses (70 ms), 256 is the pick."""
    cost = SyntheticCost(5 * MS, 0.1 * MS)
    work = bench(cost, 2000, 40, 30, 0.25)
    slos = parse_slos(["itl_p99:60"])
    static_only = SearchSpace(vllm_v1=False, thresholds=False, adaptive=False)
    result = search(work, static_only, slos, "ttft", speed_margin=margin)
    assert result.pick.point.chunk_size == best
    assert all(entry["p99_itl_ms"] <= 60 for entry in result.pick.judged)
    # With the adaptive policy in the space the pick still meets the SLO, and TTFT is no worse.
    full = search(work, SearchSpace(), slos, "ttft", speed_margin=margin)
    assert all(entry["p99_itl_ms"] <= 60 for entry in full.pick.judged)
    assert full.pick.value("ttft") >= result.pick.value("ttft")


def test_slower_machine_keeps_the_adaptive_plan_and_scales_every_step() -> None:
    """--speed-margin's run: steps take `slowdown`x as long, while the adaptive policy still
    sizes chunks with the cost model it was given (as an engine with a stale profile does)."""
    work = bench(SyntheticCost(5 * MS, 0.1 * MS), 600, 8, 6, 0.05)
    point = SweepPoint(2048, "decode-first", "adaptive", 40.0)
    nominal, slow = work.run(point), work.run(point, 2.0)
    budgets = [r.token_budget for r in nominal.records]
    assert [r.token_budget for r in slow.records][:len(budgets) // 2] == budgets[:len(budgets) // 2]
    assert slow.records[0].duration == pytest.approx(2 * nominal.records[0].duration)


def test_speed_margin_below_one_is_refused(capsys) -> None:
    assert main(["tune", "--hardware", "a100-80gb", "--speed-margin", "0.5"]) == 2
    assert "--speed-margin must be at least 1" in capsys.readouterr().err


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


def _ranked_names(entries: dict[str, dict], objective: str,
                  slos: tuple[str, ...] = ("ttft_p99:1000", "tpot_p99:100")) -> list[str]:
    from chunkserve.tune.search import Evaluated, rank

    evals = [Evaluated(SweepPoint(int(name), "decode-first"), entry, run=None)  # type: ignore[arg-type]
             for name, entry in entries.items()]
    return [str(e.point.chunk_size) for e in rank(evals, parse_slos(list(slos)), objective)]


def test_when_nothing_meets_the_slos_goodput_decides_the_closest() -> None:
    """Goodput counts the requests that met their own SLOs, so among runs that all miss an
    aggregate SLO it says which came closest; for other objectives the worst ratio does."""
    entries = {  # "512": p99 a little over (ratio 1.2) but most requests late (goodput 0.2)
        "512": {"p99_ttft_ms": 1200.0, "p99_tpot_ms": 90.0, "request_goodput": 0.2,
                "output_throughput": 50.0, "request_throughput": 1.0},
        "2048": {"p99_ttft_ms": 1500.0, "p99_tpot_ms": 95.0, "request_goodput": 0.8,
                 "output_throughput": 49.0, "request_throughput": 1.0},
    }
    assert _ranked_names(entries, "goodput") == ["2048", "512"]
    assert _ranked_names(entries, "throughput") == ["512", "2048"]
    # Goodput cannot see an ITL SLO: with one, the worst ratio decides again.
    for e in entries.values():
        e["p99_itl_ms"] = 90.0
    itl = ("ttft_p99:1000", "tpot_p99:100", "itl_p99:100")
    assert _ranked_names(entries, "goodput", itl) == ["512", "2048"]


def test_speed_margin_defaults_to_a_margin_for_profiles_only(tmp_path) -> None:
    import argparse

    from chunkserve.tune.cli import add_tune_args, check_tune_args

    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    p = argparse.ArgumentParser()
    add_tune_args(p)
    for hardware, margin in ((str(profile), 1.25), ("a100-80gb", 1.0)):
        args = p.parse_args(["--hardware", hardware])
        check_tune_args(args)
        assert args.speed_margin == margin
