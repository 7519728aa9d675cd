"""serve/http/heap.py: when the allocator settings change and when the heap is trimmed.

The RSS effect itself is measured by the stress fuzz (tests/stress/memory.py); here, the rule:
the body threshold holds while any large body is in flight, the serving thresholds come back
when the last one ends, and trims follow large bodies at once and others at most once a second.
"""
from __future__ import annotations

import pytest

from chunkserve.serve.http import heap


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    seen: list[tuple[str, int, int]] = []
    monkeypatch.setattr(heap, "_configured", True)
    monkeypatch.setattr(heap, "_mallopt", lambda p, v: seen.append(("mallopt", p, v)))
    monkeypatch.setattr(heap, "release_free_memory", lambda: seen.append(("trim", 0, 0)))
    return seen


def test_body_threshold_holds_while_any_large_body_is_in_flight(calls) -> None:
    guard = heap.HeapGuard(interval_s=3600)
    guard.large_body_begins()
    guard.large_body_begins()
    assert calls == [("mallopt", heap.M_MMAP_THRESHOLD, heap.BODY_MMAP_THRESHOLD)]
    guard.request_ends(large_body=True)
    assert calls[1:] == [("trim", 0, 0)]  # one large body still in flight: no switch back
    guard.request_ends(large_body=True)
    assert calls[2:] == [("mallopt", heap.M_MMAP_THRESHOLD, heap.SERVING_MMAP_THRESHOLD),
                         ("mallopt", heap.M_TRIM_THRESHOLD, heap.SERVING_TRIM_THRESHOLD),
                         ("trim", 0, 0)]


def test_small_requests_trim_at_most_once_per_interval(calls, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(heap.time, "monotonic", lambda: now[0])
    guard = heap.HeapGuard(interval_s=1.0)
    guard.request_ends(large_body=False)
    assert calls == []
    now[0] += 1.0
    guard.request_ends(large_body=False)
    guard.request_ends(large_body=False)
    assert calls == [("trim", 0, 0)]


def test_unconfigured_process_keeps_glibc_settings(monkeypatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(heap, "_configured", False)
    monkeypatch.setattr(heap, "_mallopt", lambda p, v: seen.append(p))
    guard = heap.HeapGuard()
    guard.large_body_begins()
    guard.request_ends(large_body=True)
    assert seen == []


def test_trim_is_callable_here() -> None:
    heap.release_free_memory()  # a no-op off glibc, malloc_trim on it: must not raise
