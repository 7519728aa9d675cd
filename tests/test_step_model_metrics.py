"""The engine's own step-time model, seen from outside: /metrics, the step trace, the log.

A server started with no scheduling flag runs the adaptive policy on the online model (issue
28): it says so at start, its gauges carry the step budget, the fitted coefficients and the
prediction error. With --max-num-batched-tokens it is static: no model, the budget as given.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.engine.trace import StepRecord, read_trace
from chunkserve.serve.metrics import ServerMetrics
from tests.server_utils import RemoteServer

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny"]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _record(**fields: object) -> StepRecord:
    return StepRecord(0, 0.0, 0.02, 16, 2, 1, 2, 3, 0, 0.1, 4, 0, 0, 0, **fields)  # type: ignore[arg-type]


def test_step_model_gauges_follow_the_records() -> None:
    sm = ServerMetrics("m", 256)
    sm.observe_step(_record(token_budget=96, predicted_duration=0.021, step_model_error=0.05,
                            step_model_coefficients={"step": 0.01, "token": 2e-4}))
    sm.observe_step(_record(token_budget=40, predicted_duration=0.02, step_model_error=0.07))
    s = _samples(sm.render()[0].decode())
    label = (("engine", "0"), ("model_name", "m"))
    assert s[("chunkserve:step_token_budget", label)] == 40  # the last step's
    assert s[("chunkserve:step_model_relative_error", label)] == pytest.approx(0.07)
    # A step that did not refit leaves the last fit in place.
    coef = {dict(k[1])["term"]: v for k, v in s.items()
            if k[0] == "chunkserve:step_model_coefficient"}
    assert coef == pytest.approx({"step": 0.01, "token": 2e-4})


def test_static_steps_leave_the_model_gauges_unset() -> None:
    sm = ServerMetrics("m", 256)
    sm.observe_step(_record(token_budget=64))
    names = {k[0] for k in _samples(sm.render()[0].decode())}
    assert "chunkserve:step_token_budget" in names
    assert "chunkserve:step_model_coefficient" not in names


@pytest.fixture(scope="module")
def auto_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RemoteServer, str]]:
    trace = str(tmp_path_factory.mktemp("trace") / "steps.jsonl")
    server = RemoteServer(tiny_model_dir, [*ARGS, "--trace-file", trace])
    yield server, trace
    server.close()


def test_server_without_flags_learns_its_step_time(auto_server: tuple[RemoteServer, str]
                                                   ) -> None:
    server, trace = auto_server
    client = server.client()
    for _ in range(3):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert "chunk policy: adaptive on the engine's own step-time model" in server.log_tail(20000)
    m = server.metrics()
    assert 0 < m.get("chunkserve:step_token_budget") <= 256
    coefficients = {dict(k[1])["term"]: v for k, v in m.samples.items()
                    if k[0] == "chunkserve:step_model_coefficient"}
    assert "token" in coefficients and "decode_context" in coefficients
    assert sum(coefficients.values()) > 0  # which terms carry the cost is the fit's business
    assert m.get("chunkserve:step_model_relative_error") >= 0
    records = read_trace(trace)
    assert all(r.predicted_duration is not None for r in records if r.num_tokens)
    assert records[0].step_model_coefficients is not None  # the warm start's fit, at once
    assert all(r.token_budget is not None and r.token_budget <= 256 for r in records)


def test_explicit_budget_is_static(tiny_model_dir: str) -> None:
    server = RemoteServer(tiny_model_dir, [*ARGS, "--max-num-batched-tokens", "48"])
    try:
        server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                           temperature=0.0)
        m = server.metrics()
        assert m.get("chunkserve:step_token_budget") == 48
        assert not any(k[0] == "chunkserve:step_model_coefficient" for k in m.samples)
        assert "chunk policy: adaptive" not in server.log_tail(20000)
    finally:
        server.close()
