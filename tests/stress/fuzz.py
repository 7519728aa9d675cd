"""Phase (a): the malformed-request fuzz and schemathesis against /openapi.json.

A malformed request must get a 4xx with an OpenAI error body, never a 5xx, a hang or a dropped
connection; a request that is valid after all must succeed (a stream ends with [DONE]).
"""
from __future__ import annotations

import json
import time
from typing import Any

from stress.fuzz_cases import Case
from stress.report import PhaseResult
from stress.target import Target
from stress.wire import KeepAliveClient, Reset, WireResponse

ERROR_KEYS = {"message", "type", "param", "code"}


def check_response(case_name: str, r: WireResponse, result: PhaseResult) -> None:
    """The response's shape: an OpenAI error body for a 4xx, a complete stream for an SSE."""
    ctype = r.headers.get("content-type", "")
    if 400 <= r.status < 500:
        try:
            body = json.loads(r.body)
            ok = set(body) == {"error"} and set(body["error"]) == ERROR_KEYS \
                and body["error"]["code"] == r.status and body["error"]["message"]
        except (ValueError, TypeError, AttributeError):
            ok = False
        if not ok:
            result.fail(f"{case_name}: {r.status} without an OpenAI error body: {r.body[:120]!r}")
    elif r.status == 200 and ctype.startswith("text/event-stream"):
        if not r.body.rstrip().endswith(b"data: [DONE]"):
            result.fail(f"{case_name}: stream did not end with [DONE]: {r.body[-120:]!r}")
    if r.status >= 500 and not (r.status == 503 and result.allow_503):
        result.fail(f"{case_name}: {r.status} {r.body[:200]!r}")


def run_fuzz(target: Target, cases: list[Case], timeout_s: float = 60.0) -> PhaseResult:
    result = PhaseResult("fuzz")
    client = KeepAliveClient("127.0.0.1", target.port, timeout=timeout_s)
    start = time.monotonic()
    slowest = (0.0, "")
    for case in cases:
        headers = dict(case.headers)
        if case.auth:
            headers.update(target.headers)
        t0 = time.monotonic()
        try:
            r = client.request(case.method, case.path, case.body, headers, case.send_body)
        except Reset as e:
            result.requests += 1
            # A fresh connection that fails is a failed request; a reused one that fails is the
            # keep-alive reset. Either way the server dropped a connection under a request.
            result.resets += 1
            result.fail(f"{case.name}: connection dropped ({'reused' if client.reused else 'fresh'}"
                        f" connection): {e}")
            continue
        took = time.monotonic() - t0
        slowest = max(slowest, (took, case.name))
        result.record(r.status)
        check_response(case.name, r, result)
    client.close()
    result.seconds = time.monotonic() - start
    result.notes.append(f"{len(cases)} cases; slowest {slowest[0]:.1f} s ({slowest[1][:60]})")
    return result


def run_schemathesis(target: Target, examples: int, seed: int = 0) -> PhaseResult:
    """Every operation of /openapi.json, positive and negative data, `examples` cases each."""
    import hypothesis
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    result = PhaseResult("schemathesis")
    # /openapi.json needs the API key like every endpoint but the probes.
    schema = schemathesis.openapi.from_url(target.url + "/openapi.json", headers=target.headers)
    session = requests.Session()
    skipped: list[str] = []
    cut_short: list[str] = []
    start = time.monotonic()
    for op_result in schema.get_all_operations():
        op = op_result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{op.method.upper()} {op.path} {mode.value}"

            @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def call(case: Any) -> None:
                try:
                    r = case.call(base_url=target.url, session=session, headers=target.headers,
                                  timeout=60)
                except requests.RequestException as e:
                    result.requests += 1
                    result.resets += 1
                    result.fail(f"{label}: {type(e).__name__}: {e}")
                    return
                result.record(r.status_code)
                if getattr(r, "stream_cut_short", False):
                    # schemathesis stops reading a stream after 20 events: a client hanging up
                    # mid-stream, not a stream the server failed to end.
                    cut_short.append(label)
                    return
                # schemathesis gives each header as a list of its values.
                headers = {k.lower(): v[0] if isinstance(v, list) else v
                           for k, v in r.headers.items()}
                wire = WireResponse(r.status_code, headers, r.content)
                check_response(f"{label} {case.body!r:.80}", wire, result)

            try:
                hypothesis.seed(seed)(call)()
            except hypothesis.errors.Unsatisfiable:  # nothing to make invalid (GET /health)
                skipped.append(label)
    result.seconds = time.monotonic() - start
    result.notes.append(f"{examples} examples per operation and mode (seeded); no negative "
                        f"data exists for {len(skipped)} of them; {len(cut_short)} streams were "
                        "cut by the client after 20 events")
    return result
