"""The engine's own step-time model (sim/online_model.py, issue 28), on synthetic step records.

The machine is a known `LinearCostModel`; the records are its step times with 5 %
multiplicative noise and, where said, 10 % of steps slowed 3-5x (a noisy neighbour). The fit
must predict held-out shapes within a few percent, follow a lasting change of the machine's
costs, shrug off a short burst of slow steps, and warm-start from its cache.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable

import numpy as np
import pytest

from chunkserve.core.chunk_budget import LearnedStepTime, StepObservation
from chunkserve.core.request import Request
from chunkserve.core.sched_output import ScheduledRequest
from chunkserve.sampling_params import SamplingParams
from chunkserve.sim.cost_model import (
    LINEAR_FEATURES,
    LinearCostModel,
    StepShape,
    linear_features,
    step_time,
)
from chunkserve.sim.fit import nonnegative_lstsq
from chunkserve.sim.online_model import CACHE_VERSION, OnlineCostModel

# A CPU-like machine: seconds per unit of each feature.
TRUE = {
    "step": 5e-3, "request": 5e-5, "token": 2e-4, "small_gemm": 1e-4,
    "prefill_attention": 2e-8, "chunk_attention": 4e-8, "decode_context": 2e-7,
    "sampled": 3e-4, "mixed": 5e-8,
}
MACHINE = LinearCostModel(TRUE)
_REQ = Request("r", [1], SamplingParams(), 0.0)  # what a ScheduledRequest points at; unread here
Step = list[ScheduledRequest]


def sr(tokens: int, start: int, decode: bool, samples: bool) -> ScheduledRequest:
    return ScheduledRequest(_REQ, tokens, start, decode, [], samples)


def true_time(step: Step, factor: float = 1.0) -> float:
    return factor * step_time(MACHINE, StepShape.from_scheduled(step))


def random_step(rng: np.random.Generator) -> Step:
    """Decode batches (1..256 at contexts up to 8k), fresh prefills (16..2048 tokens), chunks
    after cached context (up to 8k), and mixed steps of those."""
    kind = int(rng.integers(4))
    step: Step = []
    if kind in (0, 3):
        n = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]))
        step += [sr(1, int(rng.integers(8, 8192)), True, True) for _ in range(n)]
    if kind in (1, 3):
        step.append(sr(int(rng.integers(16, 2049)), 0, False, bool(rng.integers(2))))
    if kind == 2 or (kind == 3 and rng.random() < 0.5):
        step.append(sr(int(rng.integers(16, 1025)), int(rng.integers(256, 8192)), False,
                       bool(rng.integers(2))))
    return step


def probe_steps() -> list[Step]:
    """Shapes like engine/step_probe.py's: small prefills, a prompt in two chunks, decode
    batches of 1, 8 and 32, a mixed step."""
    steps: list[Step] = [[sr(32, 0, False, True)], [sr(128, 0, False, True)],
                         [sr(256, 0, False, False)], [sr(256, 256, False, True)]]
    steps += [[sr(1, c, True, True)] for c in range(384, 388)]
    steps += [[sr(1, c, True, True)] * 8 for c in range(64, 69)]
    steps += [[sr(1, 69, True, True)] * 8 + [sr(128, 0, False, True)]]
    steps += [[sr(16, 0, False, True)] * 16] * 2
    steps += [[sr(1, c, True, True)] * 32 for c in range(16, 19)]
    return steps


def measured(rng: np.random.Generator, step: Step, factor: float = 1.0,
             outliers: float = 0.0) -> float:
    """The step's duration on the machine: 5 % noise, and a fraction `outliers` 3-5x slower."""
    duration = true_time(step, factor) * (1 + 0.05 * rng.standard_normal())
    if rng.random() < outliers:
        duration *= rng.uniform(3, 5)
    return duration


def warm_model(rng: np.random.Generator, **kwargs: float) -> OnlineCostModel:
    model = OnlineCostModel(**kwargs)  # type: ignore[arg-type]
    model.fit_probe([(s, measured(rng, s)) for s in probe_steps()])
    return model


def held_out_errors(predict: Callable[[StepShape], float], factor: float = 1.0,
                    seed: int = 1000) -> np.ndarray:
    """Signed relative error of `predict` on 200 fresh shapes (none of them was fitted)."""
    rng = np.random.default_rng(seed)
    steps = [random_step(rng) for _ in range(200)]
    return np.array([predict(StepShape.from_scheduled(s)) / true_time(s, factor) - 1
                     for s in steps])


def features(step: Step) -> list[float]:
    feats = linear_features(StepShape.from_scheduled(step))
    return [feats[k] for k in LINEAR_FEATURES]


def linear(coef: np.ndarray) -> Callable[[StepShape], float]:
    return lambda shape: float(np.array([linear_features(shape)[k] for k in LINEAR_FEATURES])
                               @ coef)


# ---- the fit --------------------------------------------------------------------------------
def test_fit_recovers_known_costs_despite_noise_and_outliers() -> None:
    rng = np.random.default_rng(0)
    model = warm_model(rng)
    assert isinstance(model, LearnedStepTime)  # the engine's side of the seam
    seen: list[tuple[Step, float]] = []
    for _ in range(512):
        step = random_step(rng)
        duration = measured(rng, step, outliers=0.1)
        model.observe(step, duration)
        seen.append((step, duration))

    errors = held_out_errors(model.predict)
    # 5%: the probe's steps (single noisy measurements, never down-weighted) still pull a little.
    assert np.abs(errors).max() <= 0.05, errors
    assert abs(np.median(errors)) <= 0.01  # no bias from the slow steps
    # The terms every shape exercises come out as the machine's (request vs sampled trade
    # off against each other: only their sum per step is well determined).
    for term in ("step", "token", "decode_context", "chunk_attention"):
        # 15%: decode_context trades a little against `mixed` (the same feature on mixed steps).
        assert model.coefficients[term] == pytest.approx(TRUE[term], rel=0.15), term
    # The recent-error gauge sees the noise, not the outliers (a median).
    assert 0.01 < model.error < 0.08

    # Teeth: the same steps fitted without robustness (relative least squares, as
    # `chunkserve profile`'s fit_linear) are pulled up by the slow steps.
    X = np.array([features(s) for s, _ in seen])
    y = np.array([d for _, d in seen])
    plain = held_out_errors(linear(nonnegative_lstsq(X, y, 1 / y)))
    assert np.median(plain) >= 0.015
    assert np.median(np.abs(plain)) >= 3 * np.median(np.abs(errors))


def test_a_burst_of_slow_steps_does_not_move_the_fit() -> None:
    """32 steps 3-5x slower, the most recent and so the most weighted: Huber's weights keep
    them from swinging the fit (the noisy neighbour passes; the model should not follow)."""
    rng = np.random.default_rng(1)
    model = warm_model(rng)
    for _ in range(512):
        step = random_step(rng)
        model.observe(step, measured(rng, step))
    before = held_out_errors(model.predict)
    for _ in range(32):  # two refits happen inside the burst
        step = random_step(rng)
        model.observe(step, true_time(step) * rng.uniform(3, 5))
    after = held_out_errors(model.predict)
    assert np.abs(after).max() <= 0.05, after
    assert abs(np.median(after) - np.median(before)) <= 0.01


def _shifted_model(seed: int, steps: int, factor: float = 1.5) -> OnlineCostModel:
    """Warm-started and run on the machine, whose costs then all grow `factor`x for
    `steps` live steps (another tenant, thermal throttling, a slower NUMA node)."""
    rng = np.random.default_rng(seed)
    model = warm_model(rng)
    for _ in range(256):
        step = random_step(rng)
        model.observe(step, measured(rng, step))
    for _ in range(steps):
        step = random_step(rng)
        model.observe(step, measured(rng, step, factor=factor))
    return model


def test_fit_moves_toward_a_lasting_change_in_costs() -> None:
    model = _shifted_model(2, steps=model_window())
    ratio = 1 + held_out_errors(model.predict, factor=1.5)  # prediction / the new truth
    # Most of the way from the old costs (1/1.5 = 0.67 of the new) to the new ones.
    assert np.median(ratio) >= 0.9


def model_window() -> int:
    return OnlineCostModel().window


def test_fit_follows_a_lasting_change_within_a_window() -> None:
    model = _shifted_model(2, steps=model_window())
    errors = held_out_errors(model.predict, factor=1.5)
    assert np.abs(errors).max() <= 0.10, errors
    # A batch of short decodes, a shape live traffic is full of.
    step = [sr(1, 100, True, True)] * 64
    assert model.predict(StepShape.from_scheduled(step)) == pytest.approx(
        true_time(step, 1.5), rel=0.10)


def test_observe_reports_its_prediction_before_learning() -> None:
    rng = np.random.default_rng(3)
    model = warm_model(rng, refit_every=4, min_live=4)
    step = [sr(1, 500, True, True)] * 8
    expected = model.predict(StepShape.from_scheduled(step))
    states = [model.observe(step, true_time(step)) for _ in range(4)]
    assert states[0] is not None and states[0].predicted == pytest.approx(expected)
    refits = [s.coefficients for s in states if s is not None and s.coefficients is not None]
    assert refits and set(refits[-1]) == set(LINEAR_FEATURES)  # the 4th step refit
    assert model.observe([], 0.01) is None  # an empty step teaches nothing


# ---- the warm-start cache -------------------------------------------------------------------
IDENTITY = {"cpu": "test cpu", "model": "tiny", "dtype": "float32", "quantization": "none"}


class CountingProbe:
    """A probe callable that counts its runs (each real one costs seconds)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> list[StepObservation]:
        self.calls += 1
        rng = np.random.default_rng(self.calls)
        return [(s, measured(rng, s)) for s in probe_steps()]


def test_warm_start_probes_once_per_identity(tmp_path) -> None:
    probe = CountingProbe()
    first = OnlineCostModel(cache=str(tmp_path))
    assert first.warm_start(IDENTITY, probe) == "probed"
    assert probe.calls == 1
    files = glob.glob(str(tmp_path / "step_model" / "*.json"))
    assert len(files) == 1

    # A restart on the same machine, model, dtype: the cached fit, no probe.
    again = OnlineCostModel(cache=str(tmp_path))
    assert again.warm_start(IDENTITY, probe).startswith("cached")
    assert probe.calls == 1
    assert again.coefficients == pytest.approx(first.coefficients)
    # Warm already: nothing to do.
    assert again.warm_start(IDENTITY, probe) == "already warm" and probe.calls == 1

    # Anything in the identity changes the machine's costs: probe afresh, cache apart.
    other = OnlineCostModel(cache=str(tmp_path))
    assert other.warm_start({**IDENTITY, "dtype": "bfloat16"}, probe) == "probed"
    assert probe.calls == 2
    assert len(glob.glob(str(tmp_path / "step_model" / "*.json"))) == 2


def _cache(**fields: object) -> str:
    return json.dumps({"version": CACHE_VERSION, "identity": IDENTITY,
                       "features": list(LINEAR_FEATURES), **fields})


def _cache_bug(content: str, what: str, name: str) -> object:
    """A bad file `_read_cache` once accepted (`what`): it must be ignored like the others."""
    return pytest.param(content, id=name)


@pytest.mark.parametrize("content", [
    "{not json", "", '{"version": 1, "identity": {', json.dumps({"version": CACHE_VERSION}),
    _cache(features=["step"], steps=[]),  # features of another version of the cost model
    _cache(steps=[[[1.0], "x"]]),
    _cache_bug(json.dumps([1, 2]), "JSON that is not an object (AttributeError on .get)",
               "not-an-object"),
    _cache_bug(_cache(steps=[]), "an empty step list (IndexError in _refit)", "no-steps"),
    _cache_bug(_cache(steps=[[[1.0], 0.1, "decode"]]),
               "feature vectors of the wrong length (ValueError in every predict)",
               "short-vectors"),
])
def test_a_corrupt_cache_file_is_ignored(tmp_path, content: str) -> None:
    probe = CountingProbe()
    OnlineCostModel(cache=str(tmp_path)).warm_start(IDENTITY, probe)
    (path,) = glob.glob(str(tmp_path / "step_model" / "*.json"))
    with open(path, "w") as f:
        f.write(content)
    model = OnlineCostModel(cache=str(tmp_path))
    assert model.warm_start(IDENTITY, probe) == "probed"
    assert probe.calls == 2
    assert model.coefficients["step"] > 0
    with open(path) as f:  # and the cache is whole again
        assert json.load(f)["identity"] == IDENTITY


def test_an_unwritable_cache_does_not_stop_the_engine(tmp_path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where the cache folder would go: makedirs fails, even as root
    probe = CountingProbe()
    with caplog.at_level(logging.WARNING, logger="chunkserve.sim.online_model"):
        model = OnlineCostModel(cache=str(blocker / "cache"))
        assert model.warm_start(IDENTITY, probe) == "probed"
    assert model.coefficients["step"] > 0
    assert any("could not cache" in r.getMessage() for r in caplog.records)
    # Nothing was cached, so the next start probes again.
    assert OnlineCostModel(cache=str(blocker / "cache")).warm_start(IDENTITY, probe) == "probed"
    assert probe.calls == 2


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path))
    OnlineCostModel().warm_start(IDENTITY, CountingProbe())
    assert glob.glob(os.path.join(str(tmp_path), "step_model", "*.json"))


def test_the_probe_identity_follows_the_cpu_kernels_and_a_forced_isa(monkeypatch) -> None:
    """A cached fit of other kernels (another version's sources, or an AVX2-only CPU's set run
    by CHUNKSERVE_CPU_ISA on this one) is another machine's: its key differs."""
    from types import SimpleNamespace

    from chunkserve.config import EngineConfig
    from chunkserve.engine.step_probe import probe_identity
    from chunkserve.model.kernels import cpu_library

    for name in cpu_library.FORCED_ISA:
        monkeypatch.delenv(name, raising=False)
    loaded = SimpleNamespace(path="no-such-model.gguf")
    config = EngineConfig.from_kwargs().resolve(512)
    base = probe_identity(loaded, config)  # type: ignore[arg-type]
    assert base["cpu_kernels"] == cpu_library.source_digest()
    monkeypatch.setenv("CHUNKSERVE_CPU_ISA", "avx2")
    forced = probe_identity(loaded, config)  # type: ignore[arg-type]
    assert forced == {**base, "chunkserve_cpu_isa": "avx2"}
    monkeypatch.setattr(cpu_library, "source_digest", lambda: "other sources")
    assert probe_identity(loaded, config)["cpu_kernels"] == "other sources"  # type: ignore[arg-type]


# ---- the engine's probe ---------------------------------------------------------------------
class ProbeSpy(OnlineCostModel):
    """Keeps what the engine's start-up probe ran, to refit it on known durations."""

    observations: list[StepObservation]

    def warm_start(self, identity: dict[str, str],
                   probe: Callable[[], list[StepObservation]]) -> str:
        self.observations = probe()
        self.fit_probe(self.observations)
        return "probed"


@pytest.fixture(scope="module")
def probe_shapes(tiny_model_dir: str) -> list[Step]:
    """The step shapes engine/step_probe.py runs, as the engine runs them."""
    from chunkserve import LLM

    spy = ProbeSpy()
    llm = LLM(model=tiny_model_dir, dtype="float32", max_model_len=512,
              chunk_policy="adaptive", step_time=spy)
    llm.engine.close()
    return [list(s) for s, _ in spy.observations]


def _fit_on_machine(shapes: list[Step]) -> OnlineCostModel:
    model = OnlineCostModel()
    model.fit_probe([(s, true_time(s)) for s in shapes])  # exact times: only shapes matter
    return model


def test_probe_fit_predicts_the_shapes_it_covers(probe_shapes: list[Step]) -> None:
    kinds = [StepShape.from_scheduled(s) for s in probe_shapes]
    assert any(k.is_mixed for k in kinds)
    assert any(k.prefill and not k.decode_contexts for k in kinds)
    assert any(len(k.decode_contexts) >= 8 and not k.prefill for k in kinds)
    assert any(c > 0 for k in kinds for _, c in k.prefill)  # a chunk after cached context
    model = _fit_on_machine(probe_shapes)
    for step in ([sr(1, 300, True, True)], [sr(1, 64, True, True)] * 16,
                 [sr(200, 0, False, True)], [sr(128, 256, False, True)]):
        assert model.predict(StepShape.from_scheduled(step)) == pytest.approx(
            true_time(step), rel=0.05)


def test_probe_fit_extrapolates_to_large_chunks(probe_shapes: list[Step]) -> None:
    model = _fit_on_machine(probe_shapes)
    for tokens in (1024, 2048):
        step = [sr(tokens, 0, False, True)]
        assert model.predict(StepShape.from_scheduled(step)) == pytest.approx(
            true_time(step), rel=0.05), tokens


# ---- planning is more careful than predicting -----------------------------------------------
def test_planning_never_trusts_a_chunk_far_beyond_any_measured() -> None:
    """A fit of small steps may badly underestimate a long chunk (a 3,290-token prefill was
    planned at 0.1 s and took 2.5 s): the planner grows toward long chunks one measured step
    at a time."""
    from chunkserve.core.chunk_budget import PlannedStep
    from chunkserve.sim.online_model import TRUST_FACTOR

    rng = np.random.default_rng(5)
    model = warm_model(rng)
    largest = max(sum(n for n, _ in StepShape.from_scheduled(s).prefill) for s in probe_steps())
    within = PlannedStep(4, 400, int(TRUST_FACTOR * largest), 0)
    beyond = PlannedStep(4, 400, int(TRUST_FACTOR * largest) + 1, 0)
    assert np.isfinite(model(within)) and model(beyond) == np.inf
    big = [sr(2048, 0, False, True)]
    model.observe(big, true_time(big))  # measured once: now vouched for up to twice that
    assert np.isfinite(model(PlannedStep(4, 400, 4096, 0)))


def test_planning_margin_follows_recent_under_prediction() -> None:
    from chunkserve.core.chunk_budget import PlannedStep

    rng = np.random.default_rng(6)
    # No refit, and the re-levelling sees mostly decode steps the fit predicts exactly (their
    # median is the level): only the margin moves.
    model = warm_model(rng, refit_every=10_000, min_live=10_000)
    step = PlannedStep(2, 200, 128, 0)
    assert model.margin == 1.0 and model(step) == pytest.approx(model.predict(
        planned_shape_of(step)))
    decode = [sr(1, 300, True, True)] * 4
    for _ in range(32):  # prefill steps that run 20% over the prediction, among decodes
        s = [sr(int(rng.integers(32, 512)), 0, False, True)]
        model.observe(s, 1.2 * model.predict(StepShape.from_scheduled(s)))
        for _ in range(3):
            model.observe(decode, model.predict(StepShape.from_scheduled(decode)))
    assert model.margin == pytest.approx(1.2, rel=0.01)
    assert model(step) == pytest.approx(1.2 * model.predict(planned_shape_of(step)), rel=0.01)


@pytest.mark.parametrize("probe_factor", [0.5, 2.0])
def test_a_wrong_warm_start_is_corrected_from_the_first_step(probe_factor: float) -> None:
    """A cached probe from a busier or quieter hour (the machine 2x slower or faster than it
    said): one live step re-levels the fit, before any full refit."""
    rng = np.random.default_rng(7)
    model = OnlineCostModel()
    model.fit_probe([(s, measured(rng, s, factor=probe_factor)) for s in probe_steps()])
    step = [sr(1, 300, True, True)] * 8 + [sr(128, 0, False, True)]
    model.observe(step, measured(rng, step))
    for shape in ([sr(1, 300, True, True)] * 8, [sr(200, 0, False, True)],
                  [sr(1, 100, True, True)] * 16 + [sr(64, 0, False, True)]):
        assert model.predict(StepShape.from_scheduled(shape)) == pytest.approx(
            true_time(shape), rel=0.10)


@pytest.mark.parametrize("probe_factor", [0.5, 2.0])
def test_planning_is_right_again_once_the_fit_is(probe_factor: float) -> None:
    """Planned steps come out at the machine's step times once the fit has caught up: the
    margin is measured against the fit the planner uses now, so under-predictions the refit
    corrected (a cache twice too fast) no longer halve every chunk (they did for 64 steps)."""
    from chunkserve.core.chunk_budget import PlannedStep

    rng = np.random.default_rng(8)
    model = OnlineCostModel()
    model.fit_probe([(s, measured(rng, s, factor=probe_factor)) for s in probe_steps()])
    for _ in range(24):  # mixed steps under load, at the machine's own times
        step = [sr(1, int(rng.integers(64, 400)), True, True)] * 8
        step.append(sr(int(rng.integers(32, 256)), 0, False, True))
        model.observe(step, measured(rng, step))
    for planned in (PlannedStep(8, 8 * 200, 128, 0), PlannedStep(8, 8 * 300, 200, 0)):
        ratio = model(planned) / step_time(MACHINE, planned_shape_of(planned))
        assert 0.95 <= ratio <= 1.2, (planned, ratio)  # was 1.96 with a cache 2x too fast


def planned_shape_of(step: object) -> StepShape:
    from chunkserve.sim.cost_model import planned_shape

    return planned_shape(step)  # type: ignore[arg-type]


# ---- in the engine loop, under load (the simulator; benchmarks/simulator/stale_fit.py) -------
def test_a_wrong_warm_start_costs_at_most_the_first_step_under_load() -> None:
    """The served capacity phase on the simulator with the online model planning every step:
    a cache twice too fast ran eight steps past the token-gap target before re-levelling; now
    only the first one. A fresh warm start runs none."""
    from benchmarks.simulator import stale_fit

    starts = dict(stale_fit.WARM_STARTS)
    fresh = stale_fit.run("fresh", starts["fresh"], seed=0)
    wrong = stale_fit.run("2x fast", starts["2x fast"], seed=0)
    assert fresh["steps > 1.1x target"] == 0
    assert wrong["steps > 1.1x target"] <= 1
    assert wrong["error, steps 0-15"] <= 0.10
    assert wrong["req/s"] == pytest.approx(fresh["req/s"], rel=0.03)
