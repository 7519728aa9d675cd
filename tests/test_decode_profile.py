"""benchmarks/engine/decode_profile.py: the clock around each quantized linear counts every call
and comes off again; the report's rows add up to the step (no engine run)."""
from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository root
from benchmarks.engine import decode_profile as dp  # noqa: E402

from chunkserve.model.layers import quant_linear  # noqa: E402
from chunkserve.model.layers.linear_int4 import Int4Linear  # noqa: E402


def test_timed_linears_counts_calls_and_restores_the_method():
    plain = quant_linear.QuantizedLinear.__call__
    lin = Int4Linear(torch.randn(64, 96), torch.float32)
    spent: dict = collections.defaultdict(lambda: [0.0, 0.0])
    with dp.timed_linears(spent):
        for _ in range(3):
            lin(torch.randn(1, 96))
    assert quant_linear.QuantizedLinear.__call__ is plain
    ((key, (seconds, calls)),) = spent.items()
    assert key == ((64, 96), lin.weight_bytes) and calls == 3 and seconds > 0


def test_report_rows_and_the_rest():
    spent = {((16384, 2048), 17_000_000): (0.006, 16.0), ((128256, 2048), 270_000_000): (0.005, 1.0)}
    text = dp.report(0.020, spent, batch=1)
    assert "| 16384 x 2048 | 16 | 272 | 6.00 | 30% | 45.3 | 89.5 |" in text
    assert "| 128256 x 2048 | 1 | 270 | 5.00 | 25% | 54.0 | 52.5 |" in text
    assert "| everything else (attention, norms, RoPE, sampling, Python) | | | 9.00 | 45% | |" in text


def test_a_prefill_report_counts_the_prompt_rows():
    spent = {((2048, 2048), 2_000_000): (0.004, 16.0)}
    text = dp.report(0.010, spent, batch=1, rows=512)
    assert text.startswith("prefill of 512 tokens: step 10.00 ms")
    assert "| 2048 x 2048 | 16 | 32 | 4.00 | 40% | 8.0 | 8589.9 |" in text
