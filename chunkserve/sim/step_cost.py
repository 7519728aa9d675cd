"""The step-time model a real engine's adaptive chunk policy plans with.

By default the engine's own: an `OnlineCostModel` (online_model.py), warm-started by a few
seconds' probe of this machine and refit from the steps it serves. `--cost-model` names a fixed
one instead: a profile file written by `chunkserve profile` (this machine's steps, fitted), or
a hardware preset of the simulator (a100-80gb, ...) combined with the served model's shape.

It lives with the cost models, not in the engine: the engine takes the callable in its config
(`SchedulerConfig.step_time`) and never imports the simulator; the command line builds it.
"""
from __future__ import annotations

import os

from chunkserve.core.chunk_budget import StepTimeFn
from chunkserve.sim.cost_model import LinearCostModel, RooflineCostModel, planned_step_time
from chunkserve.sim.fit import load_profile
from chunkserve.sim.online_model import OnlineCostModel
from chunkserve.sim.specs import get_hardware, get_model


def engine_step_time(cost_model: str | None, model: str) -> StepTimeFn:
    """The callable for `--cost-model` (a profile file or a hardware preset) and `--model`;
    without one, a fresh online model (the engine warm-starts it once the model is loaded)."""
    if cost_model is None:
        return OnlineCostModel()
    if os.path.isfile(cost_model):
        prof = load_profile(cost_model)
        return planned_step_time(LinearCostModel(prof["coefficients"],
                                                 prof.get("name", cost_model)))
    # A preset: the roofline model of that GPU running this model's shape.
    return planned_step_time(RooflineCostModel(get_hardware(cost_model), get_model(model)))


def step_time_kwargs(chunk_policy: str | None, cost_model: str | None, model: str) -> dict[str, StepTimeFn]:
    """Engine keyword arguments for the policy: a step-time model for adaptive, none for static
    (a static run must not fail for want of a model it never reads)."""
    if chunk_policy != "adaptive":
        return {}
    return {"step_time": engine_step_time(cost_model, model)}
