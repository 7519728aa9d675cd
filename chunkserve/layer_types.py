"""Which layers of a model slide: Gemma 3's `layer_types` rule, shared by the model code
(model/models/gemma3.py) and the simulator (sim/specs.py), which must not import the model."""
from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' pattern for a Gemma 3 config that names neither layer_types nor a pattern.
DEFAULT_PATTERN = 6


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's attention: `layer_types`, else every `sliding_window_pattern`-th layer full
    and the rest sliding (transformers' rule for configs written before layer_types)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") \
            or DEFAULT_PATTERN
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {n} entries of {SLIDING!r} or {FULL!r}, "
                         f"got {types!r}.")
    return list(types)
