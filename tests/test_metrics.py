"""ServerMetrics against hand-computed values, read back the way a scraper would: by parsing
the exposition text rather than poking at prometheus_client internals."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.engine.trace import StepRecord
from chunkserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.serve.metrics import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    build_1_2_5_buckets,
)

MODEL = "test-model"

GAUGES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "chunkserve:kv_cache_internal_fragmentation_tokens",
]
COUNTERS = [  # exposed sample names
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "chunkserve:grammar_masked_rows_total",
    "chunkserve:grammar_mask_seconds_total",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:iteration_tokens_total",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "chunkserve:step_duration_seconds", "chunkserve:step_prefill_tokens",
    "chunkserve:step_decode_tokens",
]


def scrape(sm: ServerMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], from the rendered text."""
    body, ctype = sm.render()
    assert ctype.startswith("text/plain")
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, **labels}
    hits = [v for lab, v in samples[name] if all(lab.get(k) == x for k, x in want.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def hist(samples, name: str) -> tuple[float, float, dict[float, float]]:
    """(count, sum, {le: cumulative count}) of a histogram."""
    buckets = {float(lab["le"]): v for lab, v in samples[name + "_bucket"]
               if lab["model_name"] == MODEL}
    return value(samples, name + "_count"), value(samples, name + "_sum"), buckets


def step(i: int, prefill: int, decode: int, duration: float, preempt: int = 0) -> StepRecord:
    return StepRecord(
        step=i, start=float(i), duration=duration, num_prefill_tokens=prefill,
        num_decode_tokens=decode, num_prefill_reqs=int(prefill > 0), num_decode_reqs=decode,
        num_running=1, num_waiting=0, kv_usage=0.1, kv_blocks_used=1,
        internal_fragmentation=3, num_preemptions=preempt, num_swapped_blocks=0,
    )


def replay(sm: ServerMetrics, req_id: str, prompt_len: int, arrival: float, scheduled: float,
           token_batches: list[list[float]], finish_reason: str | None) -> None:
    """Emit outputs as the engine would: one per batch of new tokens, sharing one metrics
    object that accumulates token_times; the last output is finished if finish_reason."""
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled)
    comp = CompletionOutput(index=0, text="", token_ids=[])
    for bi, batch in enumerate(token_batches):
        m.token_times.extend(batch)
        comp.token_ids.extend(range(len(batch)))
        if m.first_token_time is None:
            m.first_token_time = batch[0]
        m.last_token_time = batch[-1]
        last = bi == len(token_batches) - 1
        if last and finish_reason is not None:
            m.finished_time = batch[-1]
            comp.finish_reason = finish_reason
        out = RequestOutput(req_id, None, list(range(prompt_len)), [comp],
                            finished=comp.finished, metrics=m)
        sm.observe_output(out, len(batch))


# Three requests with hand-picked timestamps (engine clock, seconds).
# A: prompt 10, arrives 0.0, scheduled 0.5, tokens at 1.0, 1.2, 1.5, finishes "length".
#    ttft 1.0, itl .2 .3, tpot (1.5-1.0)/2=.25, e2e 1.5, queue .5, prefill .5, decode .5
# B: prompt 4, arrives 2.0, scheduled 2.0, one token at 2.25, finishes "stop".
#    ttft .25, no itl, no tpot, e2e .25, queue 0, prefill .25, decode 0
# C: prompt 7, arrives 3.0, scheduled 3.1, tokens [3.3, 3.4] in one output (e.g. speculative),
#    then [3.6]; still running.  ttft .3, itl .1 .2
def run_scenario(sm: ServerMetrics) -> None:
    replay(sm, "A", 10, 0.0, 0.5, [[1.0], [1.2], [1.5]], "length")
    replay(sm, "B", 4, 2.0, 2.0, [[2.25]], "stop")
    replay(sm, "C", 7, 3.0, 3.1, [[3.3, 3.4], [3.6]], None)


def test_all_names_present_with_model_label() -> None:
    sm = ServerMetrics(MODEL, max_model_len=2048)
    samples = scrape(sm)
    for name in GAUGES + COUNTERS:
        assert name in samples, name
        assert all(lab["model_name"] == MODEL for lab, _ in samples[name])
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_count", "_sum"):
            assert name + suffix in samples, name + suffix
            assert all(lab["model_name"] == MODEL for lab, _ in samples[name + suffix])
    # All finish reasons exist at 0 from the start, so rate() works before the first request.
    for reason in ("stop", "length", "abort"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason) == 0


def test_exposed_metric_family_names_exact() -> None:
    body, _ = ServerMetrics(MODEL, 2048).render()
    types = {}
    for line in body.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split()
            types[name] = typ
    for name in GAUGES:
        assert types[name] == "gauge"
    for name in COUNTERS:
        assert types[name] == "counter"  # no double "_total_total", no missing suffix
    for name in HISTOGRAMS:
        assert types[name] == "histogram"
    assert "vllm:iteration_tokens_total_bucket" in body.decode()


def test_cache_config_info_carries_vllms_labels() -> None:
    body, _ = ServerMetrics(MODEL, 2048, num_kv_blocks=512, block_size=16,
                            cache_dtype="fp8").render()
    assert ('vllm:cache_config_info{block_size="16",cache_dtype="fp8",num_gpu_blocks="512"} 1.0'
            in body.decode())


def test_request_latencies_match_hand_computed() -> None:
    sm = ServerMetrics(MODEL, max_model_len=2048)
    run_scenario(sm)
    s = scrape(sm)

    count, total, _ = hist(s, "vllm:time_to_first_token_seconds")
    assert count == 3  # every request got a first token, each counted once
    assert total == pytest.approx(1.0 + 0.25 + 0.3)

    count, total, _ = hist(s, "vllm:inter_token_latency_seconds")
    assert count == (3 + 1 + 3) - 3  # total tokens - requests
    assert total == pytest.approx(0.2 + 0.3 + 0.1 + 0.2)

    count, total, _ = hist(s, "vllm:request_time_per_output_token_seconds")
    assert count == 1  # only A finished with > 1 token
    assert total == pytest.approx(0.25)

    for name, expected in [
        ("vllm:e2e_request_latency_seconds", [1.5, 0.25]),
        ("vllm:request_queue_time_seconds", [0.5, 0.0]),
        ("vllm:request_prefill_time_seconds", [0.5, 0.25]),
        ("vllm:request_decode_time_seconds", [0.5, 0.0]),
    ]:
        count, total, _ = hist(s, name)
        assert count == 2, name  # finished requests only
        assert total == pytest.approx(sum(expected)), name

    assert value(s, "vllm:prompt_tokens_total") == 10 + 4 + 7
    assert value(s, "vllm:generation_tokens_total") == 3 + 1 + 3
    count, total, buckets = hist(s, "vllm:request_prompt_tokens")
    assert (count, total) == (3, 21)
    assert buckets[5.0] == 1 and buckets[10.0] == 3  # 4 | 7, 10
    count, total, _ = hist(s, "vllm:request_generation_tokens")
    assert (count, total) == (2, 4)
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 0


def test_latency_histogram_buckets_are_vllms() -> None:
    sm = ServerMetrics(MODEL, 2048)
    run_scenario(sm)
    s = scrape(sm)
    _, _, b = hist(s, "vllm:time_to_first_token_seconds")
    assert sorted(k for k in b if math.isfinite(k)) == TTFT_BUCKETS
    assert b[0.25] == 1 and b[0.5] == 2 and b[1.0] == 3  # .25 | .3 | 1.0
    _, _, b = hist(s, "vllm:inter_token_latency_seconds")
    assert sorted(k for k in b if math.isfinite(k)) == ITL_BUCKETS
    _, _, b = hist(s, "vllm:e2e_request_latency_seconds")
    assert sorted(k for k in b if math.isfinite(k)) == REQUEST_LATENCY_BUCKETS
    _, _, b = hist(s, "vllm:request_prompt_tokens")
    assert sorted(k for k in b if math.isfinite(k)) == [1, 2, 5, 10, 20, 50, 100, 200, 500,
                                                        1000, 2000]


def test_aborts() -> None:
    sm = ServerMetrics(MODEL, 2048)
    replay(sm, "X", 5, 0.0, 0.1, [[0.4], [0.6]], "abort")  # aborted with a final output
    sm.observe_aborted()  # aborted while waiting, no output at all
    sm.observe_aborted(num_prompt_tokens=9)
    s = scrape(sm)
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 3
    count, total, _ = hist(s, "vllm:request_prompt_tokens")
    assert (count, total) == (2, 5 + 9)
    assert hist(s, "vllm:time_to_first_token_seconds")[0] == 1


def test_steps_gauges_and_counters() -> None:
    sm = ServerMetrics(MODEL, 2048)
    sm.observe_step(step(0, prefill=512, decode=0, duration=0.2))
    sm.observe_step(step(1, prefill=100, decode=3, duration=0.03, preempt=2))
    sm.observe_step(step(2, prefill=0, decode=4, duration=0.004, preempt=1))
    sm.observe_step(step(3, prefill=0, decode=0, duration=0.0005))  # idle
    sm.set_state(0, 3, 9, 0.5, 40)
    sm.set_state(0, 2, 1, 0.75, 17)  # only the last state counts
    s = scrape(sm)

    count, total, b = hist(s, "vllm:iteration_tokens_total")
    assert sorted(k for k in b if math.isfinite(k)) == [float(x) for x in
                                                        ITERATION_TOKENS_BUCKETS]
    assert ITERATION_TOKENS_BUCKETS == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                        8192, 16384]
    assert (count, total) == (3, 512 + 103 + 4)  # the idle step is not an iteration
    assert b[1.0] == 0 and b[8.0] == 1 and b[128.0] == 2 and b[512.0] == 3

    count, total, b = hist(s, "chunkserve:step_duration_seconds")
    assert count == 4 and total == pytest.approx(0.2345)
    assert b[0.001] == 1 and b[0.005] == 2
    count, total, _ = hist(s, "chunkserve:step_prefill_tokens")
    assert (count, total) == (4, 612)
    count, total, _ = hist(s, "chunkserve:step_decode_tokens")
    assert (count, total) == (4, 7)

    assert value(s, "vllm:num_preemptions_total") == 3
    assert value(s, "vllm:num_requests_running") == 2
    assert value(s, "vllm:num_requests_waiting") == 1
    assert value(s, "vllm:kv_cache_usage_perc") == 0.75
    assert value(s, "chunkserve:kv_cache_internal_fragmentation_tokens") == 17


def test_grammar_counters_sum_the_masked_steps() -> None:
    sm = ServerMetrics(MODEL, 2048)
    sm.observe_step(replace(step(0, prefill=0, decode=4, duration=0.01), num_grammar_rows=3,
                            grammar_mask_time=0.002))
    sm.observe_step(step(1, prefill=0, decode=4, duration=0.01))  # unconstrained: no change
    sm.observe_step(replace(step(2, prefill=8, decode=1, duration=0.01), num_grammar_rows=2,
                            grammar_mask_time=0.001))
    s = scrape(sm)
    assert value(s, "chunkserve:grammar_masked_rows_total") == 5
    assert value(s, "chunkserve:grammar_mask_seconds_total") == pytest.approx(0.003)


def test_instances_do_not_interfere() -> None:
    a = ServerMetrics(MODEL, 2048)
    b = ServerMetrics(MODEL, 4096)  # same model name and metric names: no registry clash
    run_scenario(a)
    a.observe_step(step(0, 8, 0, 0.01, preempt=1))
    a.set_state(0, 5, 5, 0.9, 3)
    sb = scrape(b)
    assert value(sb, "vllm:generation_tokens_total") == 0
    assert value(sb, "vllm:num_preemptions_total") == 0
    assert value(sb, "vllm:num_requests_running") == 0
    assert hist(sb, "vllm:time_to_first_token_seconds")[0] == 0
    assert value(scrape(a), "vllm:generation_tokens_total") == 7


def test_build_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000
    assert build_1_2_5_buckets(1) == [1]
