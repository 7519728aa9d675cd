"""Giving freed heap memory back to the OS (glibc), so hostile input leaves no RSS behind.

The stress fuzz (2,336 malformed requests, run twice: tests/stress/memory.py) raised a
tiny-llama server's RSS by +100.7 MiB, then +29.1 MiB, and a third pass grew it again.
tracemalloc saw +3 KB of live Python objects between passes: what grew was glibc's heap.
Multi-MiB bodies (a 7 MiB prompt, a 400,000-entry stop list) and the copies parsed from them
went into the heap once glibc's *dynamic* mmap threshold had climbed past their size, and,
freed, left holes that later allocations kept spreading into. Remedies, all no-ops off glibc:

- `configure_allocator` caps the malloc arenas at 2 (glibc's default is 8 per core), so the
  pages one large body used are reused by the next whatever thread parses it;
- `HeapGuard`, told by the HTTP layer (serve/http/middleware.py), lowers the mmap threshold to
  1 MiB while a body of 1 MiB or more is in flight, so it and its copies are mmapped and go
  back to the OS whole; afterwards the thresholds are fixed where the dynamic ones end up
  (32 MiB, trim 64 MiB). It also trims (malloc_trim) after such a request, and otherwise at
  most once a second while requests arrive (~0.3 ms a trim).

With these the same fuzz grew RSS by +54, +3, +0 MiB (docs/reliability.md, item 15).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger("chunkserve.server")
# glibc's mallopt parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MAX_ARENAS = 2
# Bodies at least this large are "large": read and parsed with the body threshold below, and
# followed by a trim at once. Rare, and each used to leave megabytes behind.
LARGE_BODY_BYTES = 1 << 20
TRIM_INTERVAL_S = 1.0
# After a large body: the ceiling glibc's dynamic mmap threshold climbs to (and its trim
# threshold, twice that), fixed, since setting one ends glibc's dynamic adjustment for good.
SERVING_MMAP_THRESHOLD = 32 << 20
SERVING_TRIM_THRESHOLD = 64 << 20
# While a large body is in flight: it and the copies parsed from it are mmapped, so freeing them
# returns them to the OS whole instead of leaving holes in the heap (the growth that repeated).
BODY_MMAP_THRESHOLD = 1 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - only glibc has it
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_configured = False


def _mallopt(param: int, value: int) -> None:
    if _LIBC is not None and not _LIBC.mallopt(param, value):
        log.debug("mallopt(%d, %d) refused", param, value)


def configure_allocator() -> None:
    """The server's allocator settings; call at startup, before its threads allocate. Until
    it is called (an in-process engine, the tests) HeapGuard only trims."""
    global _configured
    if _LIBC is None:
        return
    _mallopt(M_ARENA_MAX, MAX_ARENAS)
    # The mmap and trim thresholds stay glibc's dynamic ones until a large body arrives: fixing
    # them costs long prefills ~2-4% (docs/performance.md), which a server that never sees a
    # large body need not pay.
    _configured = True


def release_free_memory() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class HeapGuard:
    """Told by the HTTP layer when large bodies start and requests end (on the event loop)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last_trim = time.monotonic()
        self._large_in_flight = 0

    def large_body_begins(self) -> None:
        self._large_in_flight += 1
        if self._large_in_flight == 1 and _configured:
            _mallopt(M_MMAP_THRESHOLD, BODY_MMAP_THRESHOLD)

    def request_ends(self, large_body: bool) -> None:
        if large_body:
            self._large_in_flight -= 1
            if self._large_in_flight == 0 and _configured:
                _mallopt(M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
                _mallopt(M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)
        now = time.monotonic()
        if large_body or now - self._last_trim >= self.interval_s:
            self._last_trim = now
            release_free_memory()
