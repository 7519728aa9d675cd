"""torch.profiler over an engine's steps, started and stopped on demand (vLLM's
`/start_profile` and `/stop_profile`, enabled by `VLLM_TORCH_PROFILER_DIR`).

`StepProfiler` must be driven from the thread that runs the steps (the engine loop's): the
profiler's operator hooks are local to the thread that starts it, so a step's operators run on
any other thread would be missing from the trace. Each stop writes one Chrome trace
(`traceEvents` JSON, which Perfetto and chrome://tracing open) into the directory, named by
engine and time so that engines of a data-parallel server, and successive profiles, never
overwrite each other.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

import torch

log = logging.getLogger("chunkserve.engine")


class ProfilerStateError(ValueError):
    """A start while a profile runs, or a stop without one: the client's mistake (a 400)."""


def check_profiler_dir(path: str, source: str) -> str:
    """`path` as an absolute directory this process can write traces into, created if missing;
    `source` (the flag or variable that gave it) names it in the error.

    Checked when the server starts, so a bad directory is a one-line error then rather than
    a failed /stop_profile after the profile has been taken.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{source} {path!r} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{source} {path!r} cannot be created: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{source} {path!r} is not writable")
    return os.path.abspath(path)


def engine_profiler(out_dir: str | None, index: int) -> StepProfiler | None:
    """Engine `index`'s profiler, writing into `out_dir`; None when profiling is off."""
    return StepProfiler(out_dir, f"engine{index}") if out_dir is not None else None


class StepProfiler:
    def __init__(self, out_dir: str, name: str) -> None:
        """`name` starts each trace file's name: the engine it profiles (e.g. "engine0")."""
        self.out_dir = out_dir
        self.name = name
        self._prof: torch.profiler.profile | None = None
        self._num_steps = 0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        if self._prof is not None:
            raise ProfilerStateError("The profiler is already running: POST /stop_profile "
                                     "first.")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, record_shapes=False,
                                      with_stack=False)
        prof.start()
        self._prof, self._num_steps = prof, 0
        log.info("%s: profiler started", self.name)

    def stop(self) -> str:
        """Stops profiling and writes the trace; returns its path."""
        prof = self._prof
        if prof is None:
            raise ProfilerStateError("The profiler is not running: POST /start_profile first.")
        self._prof = None  # stopped even if writing fails: the next start begins afresh
        prof.stop()
        path = os.path.join(self.out_dir, f"{self.name}.{time.time_ns()}.pt.trace.json")
        prof.export_chrome_trace(path)
        log.info("%s: profiler stopped after %d steps, trace in %s", self.name,
                 self._num_steps, path)
        return path

    def discard(self) -> None:
        """Stops a running profile without writing it (the engine is shutting down)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            prof.stop()
        except Exception:  # noqa: BLE001 - shutting down anyway: never mask why
            log.exception("%s: stopping the profiler failed", self.name)
        log.warning("%s: the engine stopped while profiling: trace discarded", self.name)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wraps one engine step: a named range in the trace while profiling, else nothing."""
        if self._prof is None:
            yield
            return
        self._num_steps += 1
        with torch.profiler.record_function(f"engine_step#{self._num_steps}"):
            yield
