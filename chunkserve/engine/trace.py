"""The step trace: one record per engine step, the ground truth for every latency analysis.

The record's fields are a stable contract (docs/trace.md): the simulator emits the same records
and the benchmarks read them. Add fields at the end; never rename or drop one.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass
from typing import IO


@dataclass
class StepRecord:
    step: int
    start: float  # engine clock, seconds
    duration: float  # seconds: schedule + model + sample + bookkeeping
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    num_running: int  # after scheduling
    num_waiting: int
    kv_usage: float  # 0..1
    kv_blocks_used: int
    internal_fragmentation: int  # allocated slots minus stored tokens
    num_preemptions: int  # in this step
    num_swapped_blocks: int  # blocks copied out + in this step

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class StepTrace:
    def __init__(self, path: str | None = None, max_records: int | None = 100_000) -> None:
        # Bounded in memory so a long-running server does not grow without end; the file,
        # when asked for, keeps every step.
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self._file: IO[str] | None = open(path, "w", buffering=1) if path else None

    def keep_all(self) -> None:
        """Lifts the in-memory bound: a benchmark of bounded length needs every step."""
        self.records = deque(self.records, maxlen=None)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(asdict(record)) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str) -> list[StepRecord]:
    with open(path) as f:
        return [StepRecord(**json.loads(line)) for line in f if line.strip()]
