"""The linear cost model fitted to measured steps, and the profile file that carries it.

The steps are measured on the real engine by `chunkserve profile` (bench/calibration.py) and by
`sim --validate`'s real runs; the fit, and reading a profile back, are the simulator's own.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkserve.sim.cost_model import LINEAR_FEATURES, StepShape, linear_features
from chunkserve.sim.specs import AttentionLayers


@dataclass
class Sample:
    family: str
    shape: StepShape
    duration: float  # seconds


def fit_linear(samples: Sequence[Sample], family_weights: dict[str, float] | None = None,
               attention_layers: AttentionLayers | None = None) -> dict[str, float]:
    """Non-negative least squares on relative error (each sample weighted by 1/duration).

    Relative weighting keeps 20 ms decode steps as important as 2 s prefill steps: TPOT is
    made of the former. `family_weights` scales a whole family (default 1). Negative
    coefficients are physically meaningless; features that want one are dropped and the rest
    refitted (a small active-set loop). `attention_layers`: a sliding-window model's kinds of
    layer, for its windowed attention features (linear_features); None: every layer full.
    """
    X = np.array([[linear_features(s.shape, attention_layers)[k] for k in LINEAR_FEATURES]
                  for s in samples])
    y = np.array([s.duration for s in samples])
    # A family's weight does not grow with its sample count (1/sqrt(n) per sample), so the
    # thousands of decode steps of a live run cannot drown its few long prefills.
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.family] = counts.get(s.family, 0) + 1
    weight = family_weights or {}
    w = np.array([weight.get(s.family, 1.0) / (s.duration * np.sqrt(counts[s.family]))
                  for s in samples])
    return {k: float(c) for k, c in zip(LINEAR_FEATURES, nonnegative_lstsq(X, y, w))}


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: a feature whose coefficient comes
    out negative is dropped and the rest refitted (a small active-set loop); a feature no
    sample exercises gets 0."""
    active = [j for j in range(X.shape[1]) if X[:, j].any()]
    coef = np.zeros(X.shape[1])
    while active:
        A = X[:, active] * w[:, None]
        sol, *_ = np.linalg.lstsq(A, y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def robust_lstsq(X: np.ndarray, y: np.ndarray, w: np.ndarray, iterations: int = 4,
                 huber_k: float = 1.5, robust_rows: np.ndarray | None = None) -> np.ndarray:
    """`nonnegative_lstsq` made resistant to outliers: iteratively reweighted with Huber's
    weights on the relative residuals, scaled by their median absolute deviation.

    A step slowed 3x by a noisy neighbour then counts as a few typical steps instead of
    pulling every coefficient up; a shift that most recent steps share is not an outlier and
    moves the fit, as it should.

    `robust_rows` (a mask; default all) says which rows may be down-weighted: anchors that must
    keep their weight (the online model's probe steps, which alone fix terms live steps leave
    free) would otherwise look like outliers beside hundreds of live steps and be dropped.
    """
    mask = np.ones(len(y), bool) if robust_rows is None else robust_rows
    coef = nonnegative_lstsq(X, y, w)
    for _ in range(iterations if mask.any() else 0):
        rel = (X @ coef - y) / y
        scale = 1.4826 * float(np.median(np.abs(rel[mask] - np.median(rel[mask]))))
        if scale <= 1e-9:
            break
        huber = np.minimum(1.0, huber_k * scale / np.maximum(np.abs(rel), 1e-12))
        huber[~mask] = 1.0
        coef = nonnegative_lstsq(X, y, w * np.sqrt(huber))  # w scales rows, not squares
    return coef


def fit_errors(samples: Sequence[Sample], coefficients: dict[str, float],
               attention_layers: AttentionLayers | None = None) -> dict[str, float]:
    """Mean relative error of the fit, per shape family and overall."""
    def predict(shape: StepShape) -> float:
        feats = linear_features(shape, attention_layers)
        return sum(coefficients[k] * v for k, v in feats.items())

    errors: dict[str, list[float]] = {}
    for s in samples:
        err = abs(predict(s.shape) - s.duration) / s.duration
        errors.setdefault(s.family, []).append(err)
        errors.setdefault("all", []).append(err)
    return {family: float(np.mean(v)) for family, v in errors.items()}


def write_profile(profile_dict: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile_dict, f, indent=2)


def profile_attention_layers(profile: dict[str, Any]) -> AttentionLayers | None:
    """The kinds of layer a profile's features were fitted with (its "attention_layers": a list
    of [window or null, layers]); None for a profile without, fitted with full attention."""
    layers = profile.get("attention_layers")
    if not layers:
        return None
    return tuple((None if w is None else int(w), int(n)) for w, n in layers)


def load_profile(path: str) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if data.get("kind") != "linear" or "coefficients" not in data:
        raise ValueError(f"{path}: not a chunkserve profile (run `chunkserve profile`)")
    return data
