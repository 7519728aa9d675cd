"""`--trace-file`: the engine's step records written as they come, as JSON lines
(engine/trace.py) or as a Perfetto timeline (engine/timeline.py)."""
from __future__ import annotations

from typing import IO

from chunkserve.engine.timeline import TimelineWriter
from chunkserve.engine.trace import StepRecord, open_for_writing, record_line, trace_format_of


class StepTrace:
    """Writes every step's record to `--trace-file`: a line each, or a Perfetto timeline.
    Nothing is kept in memory: each step's record comes back in its StepResult, and a caller
    that wants a history keeps its own."""

    def __init__(self, path: str | None = None, trace_format: str | None = None) -> None:
        self._file: IO[str] | None = None
        self._timeline: TimelineWriter | None = None
        if path and trace_format_of(path, trace_format) == "perfetto":
            self._timeline = TimelineWriter(path)
        elif path:
            self._file = open_for_writing(path)

    def add(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(record_line(record))
        elif self._timeline is not None:
            self._timeline.add(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._timeline is not None:
            self._timeline.close()
            self._timeline = None
