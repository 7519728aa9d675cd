"""Which cores each tensor-parallel rank of this node computes on: vLLM's
`VLLM_CPU_OMP_THREADS_BIND`.

- unset or `auto`: the CPUs this process may use, split into equal contiguous runs, one per
  local rank (a data-parallel engine's share, frontend/engines.py, is split the same way);
- `nobind`: no binding, each rank gets an equal number of threads and the OS places them;
- explicit lists, one per local rank, separated by `|`: `0-31|32-63` (ranges and commas, as
  `taskset -c` takes them). With `--data-parallel-size`, engine i takes lists i·tp .. i·tp+tp-1.

A rank binds the thread that runs its steps before its OpenMP pool exists, so the pool's threads
inherit the cores (Linux affinity is per thread and inherited by the threads it creates).

`VLLM_CPU_NUM_OF_RESERVED_CPU=N` (vLLM's), where the engines run in processes of their own
(`-dp`, or VLLM_ENABLE_V1_MULTIPROCESSING=1): the last N of those CPUs are the API server's
(HTTP, tokenizing, detokenizing), the others the engines'; unset or 0, they share all of them.
"""
from __future__ import annotations

import os

ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,8,10-11` -> (0, 1, 2, 3, 8, 10, 11); a clear error for anything else."""
    cores: list[int] = []
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"{ENV}: {text!r} is not a CPU list like 0-3,8") from None
        if first < 0 or last < first:
            raise ValueError(f"{ENV}: bad CPU range {part.strip()!r} in {text!r}")
        cores.extend(range(first, last + 1))
    return tuple(sorted(set(cores)))


def explicit_lists(value: str | None = None) -> list[tuple[int, ...]] | None:
    """The explicit per-rank lists of the variable, or None for auto / nobind / unset."""
    value = os.environ.get(ENV, "auto") if value is None else value
    if value.strip() in ("", "auto", "nobind"):
        return None
    return [parse_cpu_list(group) for group in value.split("|")]


def reserved_cpus() -> tuple[int, ...]:
    """The CPUs kept for the API server (RESERVED_ENV): the last N this process may use."""
    text = os.environ.get(RESERVED_ENV, "0").strip() or "0"
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{RESERVED_ENV}={text!r} is not a number of CPUs") from None
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 <= n < len(cpus):
        raise ValueError(f"{RESERVED_ENV}={n}: this process may use {len(cpus)} CPU(s), and "
                         "the engines need at least one")
    return tuple(cpus[len(cpus) - n:]) if n else ()


def engine_cpus() -> list[int]:
    """The CPUs the engine processes split: all this process may use but the reserved."""
    reserved = set(reserved_cpus())
    return [c for c in sorted(os.sched_getaffinity(0)) if c not in reserved]


def rank_cores(num_ranks: int, value: str | None = None,
               available: list[int] | None = None) -> list[tuple[int, ...] | None]:
    """Each of this node's `num_ranks` ranks' cores (None: not bound, see `threads`)."""
    value = os.environ.get(ENV, "auto") if value is None else value
    if value.strip() == "nobind":
        return [None] * num_ranks
    lists = explicit_lists(value)
    if lists is not None:
        if len(lists) != num_ranks:
            raise ValueError(f"{ENV}={value!r} lists {len(lists)} CPU set(s) for {num_ranks} "
                             "tensor-parallel rank(s) on this node: give one per rank, "
                             "separated by '|'")
        return list(lists)
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    per = len(cpus) // num_ranks
    if per == 0:  # fewer CPUs than ranks: they share, round-robin
        return [(cpus[i % len(cpus)],) for i in range(num_ranks)]
    return [tuple(cpus[i * per:(i + 1) * per]) for i in range(num_ranks)]


def threads(cores: tuple[int, ...] | None, num_ranks: int) -> int:
    """A rank's compute threads: one per core it is bound to, else an equal share."""
    if cores is not None:
        return len(cores)
    return max(1, len(os.sched_getaffinity(0)) // num_ranks)


def bind_this_thread(cores: tuple[int, ...] | None) -> set[int]:
    """Binds the calling thread (and the threads it creates from now on); returns the
    affinity it had, for `unbind`."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return before
