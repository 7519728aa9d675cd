"""Model presets (chunkserve/data/models.toml): HF config.json fields under a short name.

A leaf module (it imports nothing from chunkserve) because two unrelated layers read it: the
simulator, for model shapes, and the model loader, to build a runnable model with random weights.
"""
from __future__ import annotations

import copy
import os
import tomllib
from functools import lru_cache
from typing import Any

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
_MODELS_FILE = os.path.join(DATA_DIR, "models.toml")


@lru_cache(maxsize=1)
def _presets() -> dict[str, dict[str, Any]]:
    with open(_MODELS_FILE, "rb") as f:
        return tomllib.load(f)


def model_preset_names() -> list[str]:
    return sorted(_presets())


def model_preset(name: str) -> dict[str, Any]:
    """The preset's HF config.json-shaped dict (a copy: callers may change it)."""
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(presets))}")
    return copy.deepcopy(presets[name])
