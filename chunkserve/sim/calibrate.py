"""`chunkserve profile`: time real engine steps of known shapes, fit the linear cost model.

Every sample is a whole `engine.step()` as the step trace records it (scheduling, model,
sampling, detokenization), so the fitted model predicts the same durations the benchmarks
measure. Samples come in families: steps of a mixed workload replayed live at several budgets
(the fit is made on these), and a grid of isolated shapes — prefill chunks over growing cached
context, decode batches over contexts, mixed steps — that only anchors the fit where live steps
are sparse. The fit error is reported per family, so the grid's is nearly out-of-sample.
"""
from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkserve.sim.cost_model import LINEAR_FEATURES, StepShape, linear_features


@dataclass
class Sample:
    family: str
    shape: StepShape
    duration: float  # seconds


def fit_linear(samples: Sequence[Sample],
               family_weights: dict[str, float] | None = None) -> dict[str, float]:
    """Non-negative least squares on relative error (each sample weighted by 1/duration).

    Relative weighting keeps 20 ms decode steps as important as 2 s prefill steps: TPOT is
    made of the former. `family_weights` scales a whole family (default 1). Negative
    coefficients are physically meaningless; features that want one are dropped and the rest
    refitted (a small active-set loop).
    """
    X = np.array([[linear_features(s.shape)[k] for k in LINEAR_FEATURES] for s in samples])
    y = np.array([s.duration for s in samples])
    # A family's weight does not grow with its sample count (1/sqrt(n) per sample), so the
    # thousands of decode steps of a live run cannot drown its few long prefills.
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.family] = counts.get(s.family, 0) + 1
    weight = family_weights or {}
    w = np.array([weight.get(s.family, 1.0) / (s.duration * np.sqrt(counts[s.family]))
                  for s in samples])
    active = [j for j in range(len(LINEAR_FEATURES)) if X[:, j].any()]
    coef = np.zeros(len(LINEAR_FEATURES))
    while active:
        A = X[:, active] * w[:, None]
        sol, *_ = np.linalg.lstsq(A, y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return {k: float(c) for k, c in zip(LINEAR_FEATURES, coef)}


def fit_errors(samples: Sequence[Sample], coefficients: dict[str, float]) -> dict[str, float]:
    """Mean relative error of the fit, per shape family and overall."""
    def predict(shape: StepShape) -> float:
        return sum(coefficients[k] * v for k, v in linear_features(shape).items())

    errors: dict[str, list[float]] = {}
    for s in samples:
        err = abs(predict(s.shape) - s.duration) / s.duration
        errors.setdefault(s.family, []).append(err)
        errors.setdefault("all", []).append(err)
    return {family: float(np.mean(v)) for family, v in errors.items()}


# ---- measuring on the real engine ---------------------------------------------------------------
@dataclass
class Scenario:
    family: str
    prompts: list[int]  # prompt lengths, all arriving at once
    max_tokens: int
    budget: int  # max_num_batched_tokens


def default_grid(quick: bool = False) -> list[Scenario]:
    # Whole prompts (one step each) and chunked ones (cached context grows chunk by chunk).
    prefill = [Scenario("prefill", [n], 1, n) for n in (64, 256, 1024, 4096)]
    prefill += [Scenario("prefill", [2048], 1, c) for c in (32, 128, 512)]
    decode = [
        Scenario("decode", [ctx] * b, 9, b * ctx)
        for b, ctx in ((1, 256), (1, 2048), (8, 512), (32, 256), (64, 128))
    ]
    mixed = [Scenario("mixed", [192] * 8 + [1536], 24, c) for c in (64, 512)]
    if quick:
        return [prefill[1], prefill[5], decode[2], decode[3], mixed[1]]
    return prefill + decode + mixed


def measure(loaded: Any, scenarios: Sequence[Scenario], block_size: int = 16) -> list[Sample]:
    from chunkserve.engine.llm_engine import LLMEngine
    from chunkserve.sampling_params import SamplingParams

    samples: list[Sample] = []
    for sc in scenarios:
        engine = LLMEngine.from_kwargs(
            loaded=loaded, model=loaded.path, max_num_batched_tokens=sc.budget,
            block_size=block_size, max_num_seqs=max(256, len(sc.prompts)),
        )
        engine.trace.keep_all()
        # A throwaway request first: an engine's first step pays one-off allocation costs.
        engine.add_request("warmup", [1, 2, 3], SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        params = SamplingParams(max_tokens=sc.max_tokens, temperature=0.0, ignore_eos=True)
        for i, n in enumerate(sc.prompts):
            # The mixed family's last prompt arrives once the others are decoding.
            if sc.family == "mixed" and i == len(sc.prompts) - 1:
                for _ in range(3):
                    engine.step()
                    _record(engine, sc.family, samples)
            engine.add_request(None, [100 + (7 * j + i) % 30000 for j in range(n)], params)
        while engine.has_unfinished_requests():
            engine.step()
            _record(engine, sc.family, samples)
    return samples


def last_step(engine: Any) -> tuple[StepShape, float] | None:
    """The shape and measured duration of the engine's last step; None if it ran no tokens."""
    shape = StepShape.from_scheduled(engine.last_scheduled)
    return (shape, engine.trace.records[-1].duration) if shape.num_tokens else None


def _record(engine: Any, family: str, samples: list[Sample]) -> None:
    step = last_step(engine)
    if step is None:
        return
    shape, duration = step
    if family == "mixed" and not shape.is_mixed:  # the decode steps around the mixed ones
        family = "prefill" if shape.prefill and not shape.decode_contexts else "decode"
    samples.append(Sample(family, shape, duration))


def measure_workload(loaded: Any, budgets: Sequence[int | None], num_prompts: int = 20,
                     rate: float = 0.8, seed: int = 1234, long_fraction: float = 0.25
                     ) -> list[Sample]:
    """Steps of a mixed workload replayed in real time, at each budget (None: no chunking, the
    whole prompt in one step).

    The fit is made on these: isolated steps of the grid run measurably differently from the
    same shapes inside a live run (KV blocks scattered by request churn, short prefills mixed
    into decode batches, colder caches), and a simulator replays live runs. The seed differs
    from the benchmarks' default, so validation never scores the model on its own samples.
    """
    from chunkserve.bench.sweep import replay
    from chunkserve.bench.workloads import arrival_times, sample_requests
    from chunkserve.engine.llm_engine import LLMEngine

    # More long prompts than the benchmark's 10%: the attention terms that decide latency tails
    # are only measured on long prefills, and a handful of them would leave those terms loose.
    requests = sample_requests("mixed", loaded.tokenizer, num_prompts, seed,
                               long_fraction=long_fraction)
    arrivals = arrival_times(num_prompts, rate, 1.0, seed)
    samples: list[Sample] = []

    def on_step(engine: LLMEngine) -> None:
        step = last_step(engine)
        if step is not None:
            samples.append(Sample("workload", *step))

    for budget in budgets:
        engine = LLMEngine.from_kwargs(loaded=loaded, model=loaded.path,
                                       max_num_batched_tokens=budget or loaded.max_model_len)
        replay(engine, requests, arrivals, on_step=on_step)
    return samples


# The grid's isolated shapes only anchor the coefficients where live steps are sparse (large
# decode batches, long cached contexts); at full weight they pull the fit away from what live
# runs measure (validation was up to 30% off on latency percentiles that way).
GRID_FAMILY_WEIGHT = 0.05


def profile(model: str, dtype: str, quick: bool = False, block_size: int = 16) -> dict[str, Any]:
    from chunkserve.config import DEFAULT_KV_CACHE_GIB
    from chunkserve.engine.model_runner import kv_bytes_per_block
    from chunkserve.model.factory import load_model

    t0 = time.monotonic()
    loaded = load_model(model, dtype)
    samples = measure(loaded, default_grid(quick), block_size)
    samples += measure_workload(loaded, [256] if quick else [128, 512, 2048, None],
                                num_prompts=8 if quick else 20)
    grid_weights = {s.family: GRID_FAMILY_WEIGHT for s in samples if s.family != "workload"}
    coefficients = fit_linear(samples, grid_weights)
    block_bytes = kv_bytes_per_block(loaded.model, block_size)
    return {
        "kind": "linear",
        "name": f"{platform.node() or 'this-machine'}-{platform.machine()}",
        "machine": platform.processor() or platform.machine(),
        "model": model,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "device": str(loaded.model.device),
        "block_size": block_size,
        "num_kv_blocks": int(DEFAULT_KV_CACHE_GIB * (1 << 30) // block_bytes),
        "coefficients": coefficients,
        "fit_error": fit_errors(samples, coefficients),
        "num_samples": len(samples),
        "profile_seconds": round(time.monotonic() - t0, 1),
    }


def write_profile(profile_dict: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile_dict, f, indent=2)


def load_profile(path: str) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if data.get("kind") != "linear" or "coefficients" not in data:
        raise ValueError(f"{path}: not a chunkserve profile (run `chunkserve profile`)")
    return data
