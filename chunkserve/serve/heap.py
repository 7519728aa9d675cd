"""Giving freed heap memory back to the OS (glibc), so hostile input leaves no RSS behind.

A fuzz of malformed requests raised the server's RSS by ~100 MiB in its first pass and ~30 MiB
in its second (tests/stress/memory.py): not a leak of Python objects but glibc's allocator
keeping pages once used for multi-MiB bodies (a 7 MiB prompt, a 400,000-entry stop list), in
one arena per thread that touched them (the tokenizer's worker threads, the event loop). Two
remedies, both no-ops off glibc:

- `limit_arenas` caps the malloc arenas (glibc's default is 8 per core), so a big body's pages
  are reused by the next one whatever thread parses it;
- `HeapTrimmer` returns the free pages of every arena (malloc_trim) after a request with a
  large body, and otherwise at most once a second while requests arrive: memory that small
  requests free in native code (the tokenizer, torch) is given back too, for ~0.3 ms a trim.

Measured (tiny-llama server, the stress fuzz corpus of 2,336 cases run twice; docs/reliability.md
item 15): +100.7 then +29.1 MiB before; tracemalloc saw +3 KB of live Python objects between
two passes, so what grew was allocator pages, not objects.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger("chunkserve.server")
M_ARENA_MAX = -8  # glibc's mallopt parameter number
MAX_ARENAS = 2
# Bodies at least this large are followed by a trim at once: rare, and each leaves megabytes.
TRIM_AFTER_BYTES = 1 << 20
TRIM_INTERVAL_S = 1.0


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


def limit_arenas(max_arenas: int = MAX_ARENAS) -> None:
    """Call at startup, before the server's threads allocate."""
    if _LIBC is not None and not _LIBC.mallopt(M_ARENA_MAX, max_arenas):
        log.debug("mallopt(M_ARENA_MAX) refused")


def release_free_memory() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class HeapTrimmer:
    """Decides when a finished request is followed by a trim (on the event loop)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()

    def after_request(self, body_bytes: int) -> None:
        now = time.monotonic()
        if body_bytes >= TRIM_AFTER_BYTES or now - self._last >= self.interval_s:
            self._last = now
            release_free_memory()
