"""`chunkserve bench sweep` end to end on the tiny model, plus the step-trace analysis."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chunkserve.benchlib.step_stats import linear_fit, step_metrics
from chunkserve.benchlib.sweep import parse_chunk_sizes
from chunkserve.engine.trace import StepRecord


def _record(step: int, prefill: int, decode: int, duration: float) -> StepRecord:
    return StepRecord(step, step * 1.0, duration, prefill, decode, int(prefill > 0), decode,
                      1, 0, 0.5, 4, 3, 0, 0)


def test_overhead_share_recovers_the_fixed_cost():
    # duration = 20 ms + 0.1 ms/token: steps of 10..200 tokens.
    records = [_record(i, t, 0, 0.020 + 0.0001 * t) for i, t in enumerate(range(10, 210, 10))]
    intercept, slope = linear_fit([r.num_tokens for r in records], [r.duration for r in records])
    assert intercept == pytest.approx(0.020) and slope == pytest.approx(0.0001)
    m = step_metrics(records)
    mean = sum(r.duration for r in records) / len(records)
    assert m["step_overhead_share"] == pytest.approx(0.020 / mean)
    assert m["mean_tokens_per_step"] == pytest.approx(105)


def test_chunk_sizes_parse_and_reject():
    assert parse_chunk_sizes("none, 32,2048") == [None, 32, 2048]
    with pytest.raises(ValueError, match="positive integer"):
        parse_chunk_sizes("none,-5")


def test_sweep_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run(
        [sys.executable, "-m", "chunkserve.cli", "bench", "sweep", "--model", tiny_model_dir,
         "--dtype", "float32", "--max-model-len", "512", "--num-prompts", "8",
         "--mixed-long-input-range", "200:300", "--mixed-short-input-range", "16:48",
         "--mixed-output-range", "6:10", "--mixed-long-fraction", "0.25",
         "--request-rate", "50", "--chunk-sizes", "none,32", "--goodput", "ttft:5000",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "results.json").read_text())
    assert [e["chunk_size"] for e in results] == ["none", 32]
    assert [e["scheduler"] for e in results] == ["prefill-first", "decode-first"]
    for e in results:
        assert e["completed"] == 8 and e["failed"] == 0
        for key in ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
                    "output_throughput", "request_goodput", "num_preemptions", "peak_kv_usage",
                    "mean_internal_fragmentation_tokens", "mean_step_ms", "p99_step_ms",
                    "step_overhead_share", "max_itl_ms", "p90_ttft_ms"):
            assert key in e, key
    # The no-chunk baseline runs each prompt in one step; chunking caps steps at 32 tokens.
    assert results[1]["mean_tokens_per_step"] <= 32
    table = (out / "table.md").read_text()
    assert "| none | prefill-first |" in table and "| 32 | decode-first |" in table
    assert "Best for TTFT" in table
    for png in ("latency_vs_chunk.png", "tpot_cdf.png", "step_timeline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
