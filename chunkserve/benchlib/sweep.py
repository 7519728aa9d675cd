"""A chunk-size sweep's configurations and runs, and one results.json entry per run."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from chunkserve.benchlib.metrics import RequestResult, compute_metrics
from chunkserve.benchlib.step_stats import step_metrics
from chunkserve.config import DEFAULT_MIN_CHUNK_TOKENS, target_itl_ms_or_default
from chunkserve.engine.trace import StepRecord

ChunkSize = int | None  # a step budget, or None for the no-chunk baseline ("none" in flags/JSON)
# "auto": what `chunkserve serve` runs without a flag, the adaptive policy capped by the model's
# context on the engine's own step-time model (a --chunk-sizes entry, a results.json label).
AUTO = "auto"
SizeSpec = ChunkSize | Literal["auto"]


@dataclass(frozen=True)
class SweepPoint:
    # With chunk_policy "adaptive": the cap of the per-step budget, None for the model's
    # context (the auto point); with "static": the budget, None for the no-chunk baseline.
    chunk_size: ChunkSize
    scheduler: str
    chunk_policy: str = "static"
    target_itl_ms: float | None = None  # adaptive only; None: the default
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

    @property
    def auto(self) -> bool:
        """The no-knob default: adaptive with no cap but the model's context. A real run plans
        it on a fresh online step-time model (bench/sweep.py), a simulated one on the cost
        model that times its steps."""
        return self.adaptive and self.chunk_size is None

    @property
    def no_chunk(self) -> bool:
        """The no-chunk baseline (a budget of the whole context, static)."""
        return self.chunk_size is None and not self.adaptive

    @property
    def target_ms(self) -> float | None:
        """The token-gap target an adaptive point plans toward, the default one included."""
        if not self.adaptive:
            return None
        return target_itl_ms_or_default(self.target_itl_ms)

    def policy_keys(self) -> dict[str, Any]:
        """results.json keys for what differs from a plain static point (none for one, so
        that static results keep the keys they always had)."""
        keys: dict[str, Any] = {}
        if self.adaptive:
            keys.update(chunk_policy=self.chunk_policy, target_itl_ms=self.target_ms,
                        min_chunk_tokens=self.min_chunk_tokens)
        if self.long_prefill_token_threshold:
            keys["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        return keys

    @property
    def label(self) -> int | str:
        """The chunk size as flags and JSON spell it ("auto" for the auto point)."""
        return chunk_size_to_json(AUTO if self.auto else self.chunk_size)


@dataclass
class RunResult:
    point: SweepPoint
    results: list[RequestResult]
    records: list[StepRecord]
    duration: float  # first arrival to last completion, seconds
    extra: dict[str, Any] = field(default_factory=dict)


def chunk_size_to_json(size: SizeSpec) -> int | str:
    return "none" if size is None else size


def chunk_size_from_json(value: int | str) -> SizeSpec:
    if value == AUTO:
        return AUTO
    return None if value == "none" else int(value)


def parse_chunk_sizes(text: str) -> list[SizeSpec]:
    sizes: list[SizeSpec] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "none":
            sizes.append(None)
        elif part == AUTO:
            sizes.append(AUTO)
        elif part.isdigit() and int(part) > 0:
            sizes.append(int(part))
        else:
            raise ValueError(f"--chunk-sizes: expected 'auto', 'none' or a positive integer, "
                             f"got {part!r}")
    if not sizes:
        raise ValueError("--chunk-sizes is empty")
    return sizes


def sweep_point(
    size: SizeSpec, scheduler: str, baseline: str, chunk_policy: str | None = None,
    target_itl_ms: float | None = None, min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
) -> SweepPoint:
    """The configuration a --chunk-sizes entry names. Under the adaptive policy a size is the
    cap (no policy given: static); the no-chunk baseline has no chunk to size and stays static;
    `auto` is adaptive whatever the sweep's policy, toward `target_itl_ms` (None: the default)."""
    if size is None:
        return SweepPoint(None, baseline)
    if size == AUTO:
        return SweepPoint(None, scheduler, "adaptive", target_itl_ms, min_chunk_tokens)
    policy = chunk_policy or "static"
    target = target_itl_ms if policy == "adaptive" else None
    return SweepPoint(size, scheduler, policy, target, min_chunk_tokens)


def sweep_points(
    sizes: Sequence[SizeSpec], scheduler: str, baseline: str, chunk_policy: str | None = None,
    target_itl_ms: float | None = None, min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS,
) -> list[SweepPoint]:
    """One point per size (`sweep_point`)."""
    return [sweep_point(s, scheduler, baseline, chunk_policy, target_itl_ms, min_chunk_tokens)
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
