"""A chunk-size sweep's configurations and runs, and one results.json entry per run."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkserve.benchlib.metrics import RequestResult, compute_metrics
from chunkserve.benchlib.step_stats import step_metrics
from chunkserve.engine.trace import StepRecord

ChunkSize = int | None  # a step budget, or None for the no-chunk baseline ("none" in flags/JSON)


@dataclass(frozen=True)
class SweepPoint:
    chunk_size: ChunkSize
    scheduler: str

    def engine_kwargs(self) -> dict[str, Any]:
        # None leaves the budget to EngineConfig.resolve (max_model_len for a no-chunk policy).
        return dict(scheduler=self.scheduler, max_num_batched_tokens=self.chunk_size)

    @property
    def label(self) -> int | str:
        """The chunk size as flags and JSON spell it."""
        return chunk_size_to_json(self.chunk_size)


@dataclass
class RunResult:
    point: SweepPoint
    results: list[RequestResult]
    records: list[StepRecord]
    duration: float  # first arrival to last completion, seconds
    extra: dict[str, Any] = field(default_factory=dict)


def chunk_size_to_json(size: ChunkSize) -> int | str:
    return "none" if size is None else size


def chunk_size_from_json(value: int | str) -> ChunkSize:
    return None if value == "none" else int(value)


def parse_chunk_sizes(text: str) -> list[ChunkSize]:
    sizes: list[ChunkSize] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "none":
            sizes.append(None)
        elif part.isdigit() and int(part) > 0:
            sizes.append(int(part))
        else:
            raise ValueError(f"--chunk-sizes: expected 'none' or a positive integer, got {part!r}")
    if not sizes:
        raise ValueError("--chunk-sizes is empty")
    return sizes


def sweep_points(sizes: Sequence[ChunkSize], scheduler: str, baseline: str) -> list[SweepPoint]:
    return [SweepPoint(s, baseline if s is None else scheduler) for s in sizes]


def summarize(
    run: RunResult, percentiles: list[float], goodput: dict[str, float] | None
) -> dict[str, Any]:
    """One results.json entry: the configuration, vLLM's metric keys, then ours."""
    metrics = compute_metrics(run.results, run.duration, percentiles, goodput)
    return {
        "chunk_size": run.point.label,
        "scheduler": run.point.scheduler,
        **metrics,
        **step_metrics(run.records),
        **run.extra,
    }
