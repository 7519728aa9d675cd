"""The step-time model a real engine's adaptive chunk policy plans with.

`--cost-model` names it: a profile file written by `chunkserve profile` (this machine's steps,
fitted), or a hardware preset of the simulator (a100-80gb, ...) combined with the served model's
shape. Without the flag the cached profile of this machine is used, so that profiling (minutes)
happens once, not at every start: `$CHUNKSERVE_PROFILE`, else ~/.cache/chunkserve/profile.json.

It lives with the cost models, not in the engine: the engine takes the callable in its config
(`SchedulerConfig.step_time`) and never imports the simulator; the command line builds it.
"""
from __future__ import annotations

import os

from chunkserve.core.chunk_budget import StepTimeFn
from chunkserve.sim.cost_model import LinearCostModel, RooflineCostModel, planned_step_time
from chunkserve.sim.fit import load_profile
from chunkserve.sim.specs import get_hardware, get_model


def cached_profile_path() -> str:
    return os.environ.get("CHUNKSERVE_PROFILE") or os.path.join(
        os.path.expanduser("~"), ".cache", "chunkserve", "profile.json"
    )


def engine_step_time(cost_model: str | None, model: str) -> StepTimeFn:
    """The callable for `--cost-model` (a profile file or a hardware preset) and `--model`."""
    source = cost_model or cached_profile_path()
    if os.path.isfile(source):
        prof = load_profile(source)
        return planned_step_time(LinearCostModel(prof["coefficients"], prof.get("name", source)))
    if cost_model is None:
        raise ValueError(
            f"chunk_policy 'adaptive' needs a step-time model and there is no cached profile at "
            f"{source}: run `chunkserve profile -o {source}` once on this machine, or pass "
            "--cost-model PROFILE.json or a hardware preset (e.g. a100-80gb)."
        )
    # A preset: the roofline model of that GPU running this model's shape.
    return planned_step_time(RooflineCostModel(get_hardware(cost_model), get_model(model)))


def step_time_kwargs(chunk_policy: str, cost_model: str | None, model: str) -> dict[str, StepTimeFn]:
    """Engine keyword arguments for the policy: a step-time model for adaptive, none for static
    (a static run must not fail for want of a profile it never reads)."""
    if chunk_policy != "adaptive":
        return {}
    return {"step_time": engine_step_time(cost_model, model)}
