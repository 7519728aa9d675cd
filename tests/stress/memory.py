"""Phase (a'): the fuzz corpus twice, with the server's RSS read around each pass.

A leak grows with every pass; a high-water mark (an allocator keeping pages it once needed for
a large body or prompt) is reached in the first pass and not exceeded in the second. The bounds
are the issue's: the first pass adds at most 64 MiB to the warm server, the second at most 5.
"""
from __future__ import annotations

import json
import time

from stress.fuzz import run_fuzz
from stress.fuzz_cases import Case
from stress.report import PhaseResult
from stress.target import Target
from stress.wire import KeepAliveClient

FIRST_PASS_MB = 64.0
SECOND_PASS_MB = 5.0
WARM_REQUESTS = 20


def _warm_up(target: Target) -> None:
    """Normal requests first, so the warm RSS includes what serving itself needs."""
    client = KeepAliveClient("127.0.0.1", target.port, timeout=60)
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True}
    for i in range(WARM_REQUESTS):
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        payload = body if i % 2 else {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 8}
        headers = {**target.headers, "Content-Type": "application/json"}
        client.request("POST", path, json.dumps(payload).encode(), headers, True)
    client.close()


def run_fuzz_memory(target: Target, cases: list[Case], passes: int = 2) -> PhaseResult:
    result = PhaseResult("fuzz")
    start = time.monotonic()
    _warm_up(target)
    time.sleep(0.5)
    samples = [target.rss_mb()]
    for _ in range(passes):
        one = run_fuzz(target, cases)
        result.requests += one.requests
        result.statuses.update(one.statuses)
        result.resets += one.resets
        for v in one.violations:
            result.fail(v)
        target.wait_idle()
        samples.append(target.rss_mb())
    result.seconds = time.monotonic() - start
    growth = [b - a for a, b in zip(samples, samples[1:])]
    result.notes.append("RSS " + " -> ".join(f"{mb:.0f}" for mb in samples) + " MB (warm, then "
                        "after each pass); growth per pass " + ", ".join(f"{g:+.1f}" for g in growth)
                        + " MB")
    if growth and growth[0] > FIRST_PASS_MB:
        result.fail(f"the first fuzz pass grew RSS by {growth[0]:.1f} MB "
                    f"(limit {FIRST_PASS_MB:g} MB)")
    for i, g in enumerate(growth[1:], start=2):
        if g > SECOND_PASS_MB:
            result.fail(f"fuzz pass {i} grew RSS by {g:.1f} MB (limit {SECOND_PASS_MB:g} MB): "
                        "growth that repeats is a leak")
    return result
