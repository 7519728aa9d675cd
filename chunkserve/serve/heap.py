"""Giving freed heap memory back to the OS (glibc), so hostile input leaves no RSS behind.

A fuzz of malformed requests raised the server's RSS by ~100 MiB in its first pass and ~30 MiB
in its second (tests/stress/memory.py): not a leak of Python objects but glibc's allocator
keeping pages once used for multi-MiB bodies (a 7 MiB prompt, a 400,000-entry stop list), in
one arena per thread that touched them (the tokenizer's worker threads, the event loop). Two
remedies, both no-ops off glibc:

- `limit_arenas` caps the malloc arenas (glibc's default is 8 per core), so a big body's pages
  are reused by the next one whatever thread parses it;
- `release_free_memory` (malloc_trim) returns the free pages of every arena after a request
  with a large body.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("chunkserve.server")
M_ARENA_MAX = -8  # glibc's mallopt parameter number
MAX_ARENAS = 2
# Bodies at least this large are followed by a trim: rare, and each one leaves megabytes.
TRIM_AFTER_BYTES = 1 << 20


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
