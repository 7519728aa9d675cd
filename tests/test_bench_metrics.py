"""vLLM's serving-benchmark metrics on hand-computed examples, and the printed table."""
from __future__ import annotations

import io
import math

import pytest

from chunkserve.benchlib.metrics import RequestResult, compute_metrics, print_summary


def _ok(prompt_len: int, out: int, ttft: float, itl: list[float], latency: float,
        start: float) -> RequestResult:
    return RequestResult(True, prompt_len, out, ttft, itl, latency, start)


# r1: 3 tokens, TPOT (0.2-0.1)/2 = 0.05. r2: 1 token, no TPOT. r3: 5 tokens, TPOT 0.6/4 = 0.15.
# r4 failed: it must not reach any token count or latency statistic.
RESULTS = [
    _ok(10, 3, 0.1, [0.05, 0.05], 0.2, start=0.0),
    _ok(20, 1, 0.3, [], 0.3, start=0.1),
    _ok(5, 5, 0.2, [0.1, 0.1, 0.1, 0.3], 0.8, start=1.0),
    RequestResult(False, 100, 0, 0.0, [], 0.0, 0.2, error="HTTP 500"),
]


def test_counts_and_throughputs() -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[99])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 9
    assert m["duration"] == 2.0
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    assert m["request_goodput"] is None


def test_latency_statistics_in_ms() -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[99])
    # TTFT over the three completed requests: 0.1, 0.3, 0.2 s.
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(0.02 / 3))
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # linear interpolation: 0.2 + 0.98 * 0.1
    # TPOT only from requests with more than one output token: 0.05 and 0.15 s.
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["median_tpot_ms"] == pytest.approx(100.0)
    assert m["std_tpot_ms"] == pytest.approx(50.0)
    assert m["p99_tpot_ms"] == pytest.approx(149.0)
    # ITL pools every gap of every request: .05 .05 .1 .1 .1 .3
    assert m["mean_itl_ms"] == pytest.approx(700.0 / 6)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["max_itl_ms"] == pytest.approx(300.0)
    assert m["mean_e2el_ms"] == pytest.approx(1300.0 / 3)
    assert m["median_e2el_ms"] == pytest.approx(300.0)


def test_peaks() -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[99])
    # Token arrivals: second 0 holds 0.1, 0.15, 0.2 (r1) and 0.4 (r2); second 1 holds r3's five.
    assert m["max_output_tokens_per_s"] == 5.0
    # r1 [0, 0.2) overlaps r2 [0.1, 0.4); r3 runs alone.
    assert m["max_concurrent_requests"] == 2


def test_back_to_back_requests_do_not_overlap() -> None:
    results = [_ok(1, 2, 0.5, [0.5], 1.0, start=0.0), _ok(1, 2, 0.5, [0.5], 1.0, start=1.0)]
    assert compute_metrics(results, 2.0, [99])["max_concurrent_requests"] == 1


def test_single_output_token_has_no_tpot() -> None:
    m = compute_metrics([_ok(4, 1, 0.25, [], 0.25, 0.0)], duration=1.0, selected_percentiles=[99])
    assert m["completed"] == 1 and m["total_output_tokens"] == 1
    assert m["mean_tpot_ms"] == 0.0 and m["p99_tpot_ms"] == 0.0
    assert m["mean_itl_ms"] == 0.0 and m["max_itl_ms"] == 0.0
    assert m["mean_ttft_ms"] == pytest.approx(250.0)


def test_all_failed_reports_zeros() -> None:
    m = compute_metrics([RESULTS[3]], duration=1.0, selected_percentiles=[99])
    assert m["completed"] == 0 and m["failed"] == 1 and m["total_input_tokens"] == 0
    assert m["mean_ttft_ms"] == 0.0 and m["p99_e2el_ms"] == 0.0
    assert m["max_output_tokens_per_s"] == 0.0 and m["max_concurrent_requests"] == 0


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 250.0}, 2),                     # r1, r3
    ({"ttft": 100.0}, 1),                     # a value equal to its SLO is good: r1
    ({"ttft": 250.0, "tpot": 100.0}, 1),      # r3's TPOT 150 ms fails: r1
    ({"tpot": 10.0}, 1),                      # r2 (one token) has TPOT 0 for goodput
    ({"tpot": 100.0, "e2el": 250.0}, 1),      # r2's e2el 300 ms fails: r1
    ({"ttft": 1000.0, "tpot": 1000.0, "e2el": 1000.0}, 3),  # never the failed request
    ({"e2el": 1.0}, 0),
])
def test_goodput_needs_every_slo(slos: dict[str, float], good: int) -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[99], goodput_slos=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_goodput_rejects_unknown_metric() -> None:
    with pytest.raises(ValueError, match="itl"):
        compute_metrics(RESULTS, 1.0, [99], goodput_slos={"itl": 5.0})


def test_percentile_key_names() -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[50, 90.0, 99.9])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in ("p50", "p90", "p99.9"):
            assert f"{p}_{metric}_ms" in m
        assert f"p99_{metric}_ms" not in m
    assert m["p50_e2el_ms"] == pytest.approx(m["median_e2el_ms"])


def _table(metrics: dict, **kwargs: object) -> list[str]:
    buf = io.StringIO()
    print_summary(metrics, file=buf, **kwargs)  # type: ignore[arg-type]
    return buf.getvalue().splitlines()


def test_summary_layout() -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[99],
                        goodput_slos={"ttft": 250})
    lines = _table(m, selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
                   selected_percentiles=[99], max_concurrency=4, request_rate=2.0)
    assert lines == [
        "============ Serving Benchmark Result ============",
        "Successful requests:                     3         ",
        "Failed requests:                         1         ",
        "Maximum request concurrency:             4         ",
        "Request rate configured (RPS):           2.00      ",
        "Benchmark duration (s):                  2.00      ",
        "Total input tokens:                      35        ",
        "Total generated tokens:                  9         ",
        "Request throughput (req/s):              1.50      ",
        "Request goodput (req/s):                 1.00      ",
        "Output token throughput (tok/s):         4.50      ",
        "Peak output token throughput (tok/s):    5.00      ",
        "Peak concurrent requests:                2.00      ",
        "Total token throughput (tok/s):          22.00     ",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):                          200.00    ",
        "Median TTFT (ms):                        200.00    ",
        "P99 TTFT (ms):                           298.00    ",
        "-----Time per Output Token (excl. 1st token)------",
        "Mean TPOT (ms):                          100.00    ",
        "Median TPOT (ms):                        100.00    ",
        "P99 TPOT (ms):                           149.00    ",
        "---------------Inter-token Latency----------------",
        "Mean ITL (ms):                           116.67    ",
        "Median ITL (ms):                         100.00    ",
        "P99 ITL (ms):                            290.00    ",
        "Max ITL (ms):                            300.00    ",
        "----------------End-to-end Latency----------------",
        "Mean E2EL (ms):                          433.33    ",
        "Median E2EL (ms):                        300.00    ",
        "P99 E2EL (ms):                           790.00    ",
        "==================================================",
    ]


def test_summary_defaults_skip_optional_rows() -> None:
    m = compute_metrics(RESULTS, duration=2.0, selected_percentiles=[50, 99.9])
    lines = _table(m, selected_percentiles=[50, 99.9])  # ttft,tpot,itl; rate inf; no cap
    labels = [line[:40].rstrip() for line in lines]
    for optional in ("Maximum request concurrency:", "Request rate configured (RPS):",
                     "Request goodput (req/s):", "Mean E2EL (ms):"):
        assert optional not in labels
    assert "P50 TTFT (ms):" in labels and "P99.9 ITL (ms):" in labels
    assert "{:-^50}".format("End-to-end Latency") not in lines
