"""The engine's own step-time model: the calibrated cost model's terms, learned while serving.

`chunkserve profile` fits the linear cost model (cost_model.LINEAR_FEATURES) once, offline, in
minutes. This model fits the same terms in the engine, continuously:

1. **Warm start.** A start-up probe of a few seconds (engine/step_probe.py) times a handful of
   step shapes on this machine and this model; the fit of those is cached under
   ~/.cache/chunkserve/step_model/ keyed by everything that changes step times (machine, model,
   dtype, quantization, ...), so a restart on the same machine skips the probe.
2. **Refit.** Until `min_live` live steps, each one re-levels the warm start's fit (scales it
   to how fast the machine runs now: a cached probe may come from a busier hour or older
   kernels). Then every `refit_every` steps it refits on the probe's steps plus the last `window`
   live steps, with recent steps weighted more (half-life `half_life` steps) and Huber's
   weights against outliers (fit.robust_lstsq): a step slowed by a noisy neighbour counts as a
   few typical steps, a slowdown most recent steps share moves the fit.

The probe's steps stay in every fit at `probe_weight`: live traffic may not exercise every
term for a while (no long prompt for minutes), and a term without samples would otherwise fall
to zero (and they are never down-weighted as outliers: beside hundreds of live steps they
always look like ones). The weight is small: a term only the probe measures is still set by it, while one that
live steps measure follows them. After the machine slows down by half, a window of new steps
later, a batch of 64 short decodes was predicted 37% low at a probe weight of 0.3, 16% low at
0.05 and 4% low at 0.02 (tests/test_online_model.py's synthetic machine). Each step the engine gets back the model's prediction for that step (made before it
saw the step) and the median relative error of recent predictions, for the trace and /metrics.

Planning (`__call__`) is more careful than predicting: it adds the model's recent
under-prediction on prefill steps (`margin`) and refuses chunks far beyond any it has measured
(TRUST_FACTOR), so the budget grows toward long chunks one measured step at a time.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chunkserve.core.chunk_budget import (
    PlannedStep,
    StepModelState,
    StepObservation,
)
from chunkserve.core.sched_output import ScheduledRequest
from chunkserve.sim.cost_model import LINEAR_FEATURES, StepShape, linear_features, planned_shape
from chunkserve.sim.fit import robust_lstsq
from chunkserve.sim.specs import AttentionLayers

logger = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the probe or the features change: old cache files are ignored
TRUST_FACTOR = 2.0  # a planned chunk at most this many times the largest measured one
MARGIN_STEPS = 64  # the recent steps with prefill whose under-prediction sets `margin`
TOKEN = LINEAR_FEATURES.index("token")


def cache_dir() -> str:
    """$CHUNKSERVE_CACHE_DIR, else ~/.cache/chunkserve."""
    return os.environ.get("CHUNKSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "chunkserve")


def _features(shape: StepShape, layers: AttentionLayers | None = None) -> np.ndarray:
    feats = linear_features(shape, layers)
    return np.array([feats[k] for k in LINEAR_FEATURES])


def _chunk_tokens(shape: StepShape) -> int:
    return sum(n for n, _ in shape.prefill)


def _family(shape: StepShape) -> str:
    if shape.is_mixed:
        return "mixed"
    return "prefill" if shape.prefill else "decode"


class OnlineCostModel:
    """A `core.chunk_budget.LearnedStepTime`: call it to predict, `observe` to teach it."""

    def __init__(self, window: int = 512, half_life: float = 128.0, refit_every: int = 16,
                 probe_weight: float = 0.02, min_live: int = 16, cache: str | None = None,
                 attention_layers: AttentionLayers | None = None) -> None:
        self.window, self.half_life, self.refit_every = window, half_life, refit_every
        self.probe_weight, self.min_live = probe_weight, min_live
        self.cache = cache  # folder; None: cache_dir() at warm start
        # A sliding-window model's kinds of layer: its attention features are windowed
        # (cost_model.linear_features). None: every layer full, the features as before.
        self.attention_layers = attention_layers
        self.coef: np.ndarray | None = None
        self._probe: list[tuple[np.ndarray, float, str]] = []
        self._live: deque[tuple[np.ndarray, float, str]] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=64)
        self._since_refit = 0
        self._reported = False  # the first observed step reports the warm start's coefficients
        # Recent steps that ran prefill (the ones planned up to the target), as (features,
        # seconds): their measured / predicted sets the planner's margin (`margin`).
        self._prefill_steps: deque[tuple[np.ndarray, float]] = deque(maxlen=MARGIN_STEPS)
        self._margin = 1.0
        self._largest_chunk = 0  # the most prefill tokens of any step measured (probe or live)
        self._probe_coef: np.ndarray | None = None  # the fit of the probe's steps alone

    # ---- predicting ---------------------------------------------------------------------------
    @property
    def coefficients(self) -> dict[str, float]:
        assert self.coef is not None, "warm_start() first"
        return {k: float(c) for k, c in zip(LINEAR_FEATURES, self.coef)}

    def __call__(self, step: PlannedStep) -> float:
        """The planner's prediction: conservative where the fit is unsure. A chunk more than
        TRUST_FACTOR times the largest one ever measured is not vouched for (infinite), so
        the budget grows toward long chunks step by step, each measured, instead of jumping
        to a shape a fit of small steps may badly underestimate (a 3,290-token prefill was
        predicted at 0.1 s and took 2.5 s before this rule). And the prediction carries the
        model's recent under-prediction on prefill steps (`margin`)."""
        if step.num_prefill_tokens > TRUST_FACTOR * max(self._largest_chunk, 1):
            return math.inf
        return self.predict(planned_shape(step)) * self.margin

    @property
    def margin(self) -> float:
        """The 90th percentile of measured / predicted (by the current fit) over the last 64
        steps with prefill, between 1 and 2: planning against it keeps most steps near the target under it (a
        token gap's p99 is made of those steps) rather than half of them above."""
        return self._margin

    def _update_margin(self) -> None:
        """`margin` against the coefficients the planner uses now. Predicted by them, not by
        the ones each step was planned with: after a refit has corrected a wrong warm start
        (the machine twice as fast as its cached probe said), steps the old fit under-predicted
        must not keep the margin at 2 for another 64 steps with prefill, halving every chunk
        (measured on a Zen 3: half the chunk, twice the median token gap, until they aged out).
        Between refits the coefficients do not change, so it is the out-of-sample ratio."""
        if len(self._prefill_steps) < 8:
            self._margin = 1.0
            return
        assert self.coef is not None
        x = np.array([r[0] for r in self._prefill_steps])
        measured = np.array([r[1] for r in self._prefill_steps])
        ratios = measured / np.maximum(x @ self.coef, 1e-9)
        self._margin = float(np.clip(np.quantile(ratios, 0.9), 1.0, 2.0))

    def predict(self, shape: StepShape) -> float:
        assert self.coef is not None, "warm_start() first"
        return float(_features(shape, self.attention_layers) @ self.coef)

    @property
    def error(self) -> float:
        """Median relative error of the last 64 predictions (0 before any)."""
        return float(np.median(self._errors)) if self._errors else 0.0

    # ---- learning -----------------------------------------------------------------------------
    def warm_start(self, identity: dict[str, str],
                   probe: Callable[[], list[StepObservation]]) -> str:
        if self.coef is not None:
            return "already warm"
        path = self._cache_path(identity)
        cached = _read_cache(path, identity)
        if cached is not None:
            self._probe, self._probe_coef = cached, None
            # The cache keeps features only; a prefill step's tokens bound its chunk.
            self._largest_chunk = int(max((x[TOKEN] for x, _, fam in cached if fam != "decode"),
                                          default=0))
            self._refit()
            return f"cached ({path})"
        self.fit_probe(probe())
        _write_cache(path, identity, self._probe)
        return "probed"

    def fit_probe(self, observations: Sequence[StepObservation]) -> None:
        """The warm start's fit: the probe's steps alone."""
        self._probe = []
        for scheduled, duration in observations:
            shape = StepShape.from_scheduled(scheduled)
            if shape.num_tokens and duration > 0:
                self._probe.append((_features(shape, self.attention_layers), duration,
                                    _family(shape)))
                self._largest_chunk = max(self._largest_chunk, _chunk_tokens(shape))
        if not self._probe:
            raise ValueError("the step-time probe measured no step")
        self._probe_coef = None
        self._refit()

    def observe(self, scheduled: Sequence[ScheduledRequest], duration: float
                ) -> StepModelState | None:
        """One live step. None for a step that ran no tokens (there is nothing to learn)."""
        shape = StepShape.from_scheduled(scheduled)
        if not shape.num_tokens or duration <= 0 or self.coef is None:
            return None
        x = _features(shape, self.attention_layers)
        predicted = float(x @ self.coef)
        self._errors.append(abs(predicted - duration) / duration)
        chunk = _chunk_tokens(shape)
        if chunk:
            self._prefill_steps.append((x, duration))
            self._largest_chunk = max(self._largest_chunk, chunk)
        self._live.append((x, duration, _family(shape)))
        self._since_refit += 1
        # Before `min_live` live steps, every step re-levels the warm start (`_relevel`); the
        # first full refit comes at `min_live`, then one every `refit_every`.
        num_live = len(self._live)
        refit = num_live >= self.min_live and (self._since_refit >= self.refit_every
                                               or num_live == self.min_live)
        relevel = num_live < self.min_live
        if refit:
            self._refit()
        elif relevel:
            self._relevel()
        self._update_margin()
        new_fit = refit or relevel or not self._reported
        self._reported = True
        return StepModelState(predicted, self.error, self.coefficients if new_fit else None)

    def _relevel(self) -> None:
        """Before `min_live` live steps, too few to refit every term on: the warm start's fit
        scaled to the level the live steps show so far (`_level`, a median: one odd step
        among several does not move it). A cached probe from a quieter or busier hour, or
        from older kernels, is corrected from the first step on rather than at `min_live`:
        with a cache twice too fast, the first eight steps of a Zen 3's server ran at twice
        the token-gap target (the margin needs eight steps with prefill, the refit sixteen)."""
        self._since_refit = 0
        assert self._probe_coef is not None
        live = list(self._live)
        self.coef = self._probe_coef * self._level(np.array([r[0] for r in live]),
                                                   np.array([r[1] for r in live]))

    def _refit(self) -> None:
        self._since_refit = 0
        rows = self._probe + list(self._live)
        X = np.array([r[0] for r in rows])
        y = np.array([r[1] for r in rows])
        live = np.arange(len(rows)) >= len(self._probe)  # the probe's steps are anchors
        if self._probe_coef is None:
            self._probe_coef = robust_lstsq(X[~live], y[~live], self._weights(rows)[~live])
        elif live.any():
            y[~live] *= self._level(X[live], y[live])
        self.coef = robust_lstsq(X, y, self._weights(rows), robust_rows=live)

    def _level(self, X: np.ndarray, y: np.ndarray) -> float:
        """How much slower (> 1) or faster the machine runs now than during the probe: the
        median of measured / the probe fit's prediction over the live window. The probe's
        steps enter the fit at that level, so they keep the *shape* of the costs (which term
        costs what) while live steps set how fast the machine is: a lasting slowdown moves the
        whole fit rather than bending it between old anchors and new steps."""
        assert self._probe_coef is not None
        predicted = X @ self._probe_coef
        ok = predicted > 0
        if not ok.any():
            return 1.0
        return float(np.clip(np.median(y[ok] / predicted[ok]), 0.25, 4.0))

    def _weights(self, rows: list[tuple[np.ndarray, float, str]]) -> np.ndarray:
        """Relative error (1/duration: a 20 ms decode step matters as much as a 2 s prefill),
        each family's weight independent of how many steps it has (1/sqrt(n), as fit_linear),
        live steps decaying with age, the probe's at `probe_weight`."""
        num_probe = len(self._probe)
        counts: dict[tuple[bool, str], int] = {}
        for i, r in enumerate(rows):
            key = (i < num_probe, r[2])
            counts[key] = counts.get(key, 0) + 1
        num_live = len(rows) - num_probe
        w = np.empty(len(rows))
        for i, (_, duration, family) in enumerate(rows):
            is_probe = i < num_probe
            base = 1.0 / (duration * np.sqrt(counts[(is_probe, family)]))
            if is_probe:
                w[i] = base * self.probe_weight
            else:
                age = num_live - 1 - (i - num_probe)
                w[i] = base * 0.5 ** (age / (2 * self.half_life))  # sqrt: w scales rows
        return w

    # ---- the warm-start cache -----------------------------------------------------------------
    def _cache_path(self, identity: dict[str, str]) -> str:
        # Windowed features are other numbers for the same steps: another cache entry (a
        # model without windows keeps its key, and its cached probe).
        layers = {} if self.attention_layers is None else {
            "attention_layers": [list(kind) for kind in self.attention_layers]}
        key = json.dumps({"version": CACHE_VERSION, **identity, **layers}, sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return os.path.join(self.cache or cache_dir(), "step_model", f"{digest}.json")


def _read_cache(path: str, identity: dict[str, str]
                ) -> list[tuple[np.ndarray, float, str]] | None:
    """The cached probe steps; None (probe afresh) for anything but a valid file of this
    identity and version: a cache must never stop a server from starting."""
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return None
        if data.get("identity") != identity or data.get("features") != list(LINEAR_FEATURES):
            return None  # a hash collision, or features of another version
        steps = [(np.array(x, dtype=float), float(d), str(fam)) for x, d, fam in data["steps"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    valid = all(x.shape == (len(LINEAR_FEATURES),) and np.isfinite(x).all() and d > 0
                for x, d, _ in steps)
    return steps if steps and valid else None


def _write_cache(path: str, identity: dict[str, str],
                 steps: list[tuple[np.ndarray, float, str]]) -> None:
    data: dict[str, Any] = {
        "version": CACHE_VERSION, "identity": identity, "features": list(LINEAR_FEATURES),
        "steps": [[x.tolist(), d, fam] for x, d, fam in steps],
    }
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # atomic: two servers starting at once never read half a file
    except OSError as e:  # a read-only home is no reason not to serve: probe next time too
        logger.warning("could not cache the step-time probe at %s: %s", path, e)
