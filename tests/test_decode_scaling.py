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
    assert "| 1 | 6.5 | 1.0 | 8.5 | 1.0 | 2.8 | 1.0 | 0.4 |  |" in text
    assert "| 64 | 76.2 | 11.7 | 253.5 | 29.8 | 24.1 | 8.6 | 3.7 | <= 3.0x |" in text
    assert "<= 2.5x" in text.splitlines()[3]
