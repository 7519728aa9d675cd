"""A chunk-size sweep's configurations and runs, and one results.json entry per run."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkserve.benchlib.metrics import RequestResult, compute_metrics
from chunkserve.benchlib.step_stats import step_metrics
from chunkserve.config import DEFAULT_MIN_CHUNK_TOKENS
from chunkserve.engine.trace import StepRecord

ChunkSize = int | None  # a step budget, or None for the no-chunk baseline ("none" in flags/JSON)


@dataclass(frozen=True)
class SweepPoint:
    chunk_size: ChunkSize  # with chunk_policy "adaptive": the cap of the per-step budget
    scheduler: str
    chunk_policy: str = "static"
    target_itl_ms: float | None = None  # adaptive only
    min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS  # adaptive only
    long_prefill_token_threshold: int = 0  # 0: off

    def engine_kwargs(self) -> dict[str, Any]:
        # None leaves the budget to EngineConfig.resolve (max_model_len for a no-chunk policy).
        return dict(scheduler=self.scheduler, max_num_batched_tokens=self.chunk_size,
                    chunk_policy=self.chunk_policy, target_itl_ms=self.target_itl_ms,
                    min_chunk_tokens=self.min_chunk_tokens,
                    long_prefill_token_threshold=self.long_prefill_token_threshold)

    @property
    def adaptive(self) -> bool:
        return self.chunk_policy == "adaptive"

    def policy_keys(self) -> dict[str, Any]:
        """results.json keys for what differs from a plain static point (none for one, so
        that static results keep the keys they always had)."""
        keys: dict[str, Any] = {}
        if self.adaptive:
            keys.update(chunk_policy=self.chunk_policy, target_itl_ms=self.target_itl_ms,
                        min_chunk_tokens=self.min_chunk_tokens)
        if self.long_prefill_token_threshold:
            keys["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        return keys

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


def sweep_points(
    sizes: Sequence[ChunkSize], scheduler: str, baseline: str, chunk_policy: str = "static",
    target_itl_ms: float | None = None, min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
) -> list[SweepPoint]:
    """One point per size. An adaptive sweep sizes chunks under each cap; the no-chunk baseline
    has no chunk to size and stays static."""
    return [SweepPoint(None, baseline) if s is None
            else SweepPoint(s, scheduler, chunk_policy, target_itl_ms, min_chunk_tokens)
            for s in sizes]


def summarize(
    run: RunResult, percentiles: list[float], goodput: dict[str, float] | None
) -> dict[str, Any]:
    """One results.json entry: the configuration, vLLM's metric keys, then ours."""
    metrics = compute_metrics(run.results, run.duration, percentiles, goodput)
    return {
        "chunk_size": run.point.label,
        "scheduler": run.point.scheduler,
        **run.point.policy_keys(),
        **metrics,
        **step_metrics(run.records),
        **run.extra,
    }
