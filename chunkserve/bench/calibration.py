"""`chunkserve profile`: time real engine steps of known shapes, fit the simulator's linear
cost model (sim/fit.py) to them.

Every sample is a whole `engine.step()` as the step trace records it (scheduling, model,
sampling, detokenization), so the fitted model predicts the same durations the benchmarks
measure. Samples come in families: steps of a mixed workload replayed live at several budgets
(the fit is made on these), and a grid of isolated shapes — prefill chunks over growing cached
context, decode batches over contexts, mixed steps — that only anchors the fit where live steps
are sparse. The fit error is reported per family, so the grid's is nearly out-of-sample.
"""
from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkserve.bench.sweep import run_point
from chunkserve.benchlib.sweep import SweepPoint
from chunkserve.benchlib.workloads import arrival_times, sample_requests
from chunkserve.config import DEFAULT_KV_CACHE_GIB, DTYPES
from chunkserve.engine.llm_engine import LLMEngine, StepResult
from chunkserve.sampling_params import SamplingParams
from chunkserve.sim.cost_model import StepShape
from chunkserve.sim.fit import Sample, fit_errors, fit_linear, write_profile

if TYPE_CHECKING:  # the model (torch) is imported only by a command that loads one
    from chunkserve.model.factory import LoadedModel


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


def measure(loaded: LoadedModel, scenarios: Sequence[Scenario], block_size: int = 16
            ) -> list[Sample]:
    samples: list[Sample] = []
    for sc in scenarios:
        engine = LLMEngine.from_kwargs(
            loaded=loaded, model=loaded.path, max_num_batched_tokens=sc.budget,
            block_size=block_size, max_num_seqs=max(256, len(sc.prompts)),
        )
        # A throwaway request first: an engine's first step pays one-off allocation costs.
        engine.add_request("warmup", [1, 2, 3], SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        params = SamplingParams(max_tokens=sc.max_tokens, temperature=0.0, ignore_eos=True)
        for i, n in enumerate(sc.prompts):
            # The mixed family's last prompt arrives once the others are decoding.
            if sc.family == "mixed" and i == len(sc.prompts) - 1:
                for _ in range(3):
                    _record(engine.step(), sc.family, samples)
            engine.add_request(None, [100 + (7 * j + i) % 30000 for j in range(n)], params)
        while engine.has_unfinished_requests():
            _record(engine.step(), sc.family, samples)
    return samples


def step_sample(step: StepResult) -> tuple[StepShape, float] | None:
    """A step's shape and measured duration; None if it ran no tokens."""
    shape = StepShape.from_scheduled(step.scheduled)
    return (shape, step.record.duration) if shape.num_tokens else None


def _record(step: StepResult, family: str, samples: list[Sample]) -> None:
    sample = step_sample(step)
    if sample is None:
        return
    shape, duration = sample
    if family == "mixed" and not shape.is_mixed:  # the decode steps around the mixed ones
        family = "prefill" if shape.prefill and not shape.decode_contexts else "decode"
    samples.append(Sample(family, shape, duration))


def measure_workload(loaded: LoadedModel, budgets: Sequence[int | None], num_prompts: int = 20,
                     rate: float = 0.8, seed: int = 1234, long_fraction: float = 0.25
                     ) -> list[Sample]:
    """Steps of a mixed workload replayed in real time, at each budget (None: no chunking, the
    whole prompt in one step).

    The fit is made on these: isolated steps of the grid run measurably differently from the
    same shapes inside a live run (KV blocks scattered by request churn, short prefills mixed
    into decode batches, colder caches), and a simulator replays live runs. The seed differs
    from the benchmarks' default, so validation never scores the model on its own samples.
    """
    # More long prompts than the benchmark's 10%: the attention terms that decide latency tails
    # are only measured on long prefills, and a handful of them would leave those terms loose.
    requests = sample_requests("mixed", loaded.tokenizer, num_prompts, seed,
                               long_fraction=long_fraction)
    arrivals = arrival_times(num_prompts, rate, 1.0, seed)
    samples: list[Sample] = []

    def on_step(step: StepResult) -> None:
        sample = step_sample(step)
        if sample is not None:
            samples.append(Sample("workload", *sample))

    for budget in budgets:
        # No chunking: orca (decodes plus whole prompts, mixed), the shapes the profile has
        # always measured there (decode-first at a budget of max_model_len runs the same steps).
        point = SweepPoint(budget, "decode-first" if budget else "orca")
        run_point(loaded, point, requests, arrivals, {}, on_step)
    return samples


# The grid's isolated shapes only anchor the coefficients where live steps are sparse (large
# decode batches, long cached contexts); at full weight they pull the fit away from what live
# runs measure (validation was up to 30% off on latency percentiles that way).
GRID_FAMILY_WEIGHT = 0.05


def profile(model: str, dtype: str, quick: bool = False, block_size: int = 16) -> dict[str, Any]:
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
        # int8 weights keep a dense copy for prefill rows: the dtype alone does not say what
        # was timed.
        "quantization": loaded.model.quantization or "none",
        "device": str(loaded.model.device),
        "block_size": block_size,
        "num_kv_blocks": int(DEFAULT_KV_CACHE_GIB * (1 << 30) // block_bytes),
        "coefficients": coefficients,
        "fit_error": fit_errors(samples, coefficients),
        "num_samples": len(samples),
        "profile_seconds": round(time.monotonic() - t0, 1),
    }


def load_profiled_model(prof: dict[str, Any], max_model_len: int | None = None) -> LoadedModel:
    """The model a profile timed, in the weights format it timed: replaying a workload on other
    weights (e.g. dense float32 under an int8 profile) compares two different engines. A
    profile written before the format was recorded timed dense weights."""
    from chunkserve.model.factory import load_model

    return load_model(prof["model"], prof.get("dtype", "auto"), max_model_len,
                      quantization=prof.get("quantization", "none"))


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a 4-scenario grid (tests, smoke runs)")
    p.add_argument("--output", "-o", default="profile.json")


def run_profile(args: argparse.Namespace) -> int:
    prof = profile(args.model, args.dtype, args.quick, args.block_size)
    write_profile(prof, args.output)
    print(f"{prof['num_samples']} steps timed in {prof['profile_seconds']} s; wrote {args.output}")
    for name, value in prof["coefficients"].items():
        print(f"  {name:<18} {value * 1e3:12.6f} ms per unit")
    print("fit error (mean relative):")
    for family, err in prof["fit_error"].items():
        print(f"  {family:<10} {err:6.1%}")
    return 0
