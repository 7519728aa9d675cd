"""benchmarks/engine/decode_scaling.py's parsing of llama-batched-bench and its table, on
recorded output (no build, no run)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository root
from benchmarks.engine import decode_scaling as ds  # noqa: E402

# llama-batched-bench's output on a Zen 5 (2026-12-02), log lines around the table kept.
RECORDED = """
llama_batched_bench: n_kv_max = 36096, n_batch = 2048, n_ubatch = 512, flash_attn = -1
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   512 |     24 |    1 |    536 |    1.418 |   361.08 |    0.222 |   108.03 |    1.640 |   326.81 |
|   512 |     24 |    8 |   4288 |   10.032 |   408.28 |    0.863 |   222.61 |   10.895 |   393.59 |
|   512 |     24 |   64 |  34304 |   84.818 |   386.33 |    6.252 |   245.69 |   91.070 |   376.68 |

llama_perf_context_print:        load time =     123.45 ms
"""


def test_step_times_come_from_the_tg_column():
    steps = ds.parse_batched_bench(RECORDED)
    assert sorted(steps) == [1, 8, 64]
    assert abs(steps[1] - 0.222 / 24 * 1e3) < 1e-9 and abs(steps[64] - 6.252 / 24 * 1e3) < 1e-9
    assert ds.parse_batched_bench("no table here\n| a | b |") == {}


def test_table_gives_ratios_to_each_engines_own_b1_and_the_targets():
    rows = [ds.Row(1, 6.5, 8.5, 2.8), ds.Row(32, 42.9, 139.5, 12.2), ds.Row(64, 76.2, 253.5, 24.1)]
    text = ds.table(rows)
    assert "| 1 | 6.5 | 1.0 | 8.5 | 1.0 | 2.8 | 1.0 | 0.4 | 0.76 |  |" in text
    assert "| 64 | 76.2 | 11.7 | 253.5 | 29.8 | 24.1 | 8.6 | 3.7 | 0.30 | <= 3.0x |" in text
    assert "<= 2.5x" in text.splitlines()[3]


# llama-bench -o json on a Zen 4 (2026-12-07), one prompt test and one generation test, the
# fields the parser reads and a few around them.
LLAMA_BENCH_JSON = """[
  {"model_type": "llama 1B Q4_0", "n_threads": 2, "n_prompt": 512, "n_gen": 0,
   "avg_ns": 1954000000, "avg_ts": 262.03, "samples_ts": [262.03]},
  {"model_type": "llama 1B Q4_0", "n_threads": 2, "n_prompt": 2048, "n_gen": 0,
   "avg_ts": 229.4, "samples_ts": [229.4]},
  {"model_type": "llama 1B Q4_0", "n_threads": 2, "n_prompt": 0, "n_gen": 16,
   "avg_ts": 53.1, "samples_ts": [53.1]}
]"""


def test_prefill_rates_come_from_llama_bench_prompt_tests():
    assert ds.parse_llama_bench(LLAMA_BENCH_JSON) == {512: 262.03, 2048: 229.4}
    text = ds.prefill_table([ds.PrefillRow(512, 450.0, 262.0), ds.PrefillRow(2048, 399.0, 229.4)])
    assert "| 512 | 450 | 262 | 1.72 |" in text and "| 2048 | 399 | 229 | 1.74 |" in text


def test_bad_arguments_are_one_line_errors(monkeypatch, capsys, tmp_path):
    import pytest

    for argv, said in ((["--batches", "8,32"], "must include 1"),
                       (["--prefill-sizes", "8192"], "at most 4096"),
                       (["--model", str(tmp_path / "none.gguf")], "not found")):
        monkeypatch.setattr(sys, "argv", ["decode_scaling.py", *argv])
        with pytest.raises(SystemExit) as e:
            ds.parse_args()
        assert e.value.code == 2 and said in capsys.readouterr().err
