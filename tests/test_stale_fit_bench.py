"""benchmarks/serving/stale_fit_served.py's wrong warm starts: each variant's cache folder is
one the engine's step-time model reads as its own (same key, same identity), with the probed
steps' durations scaled, or another file's steps (no server started here)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository root
from benchmarks.serving import stale_fit_served as sfs  # noqa: E402
from chunkserve.sim.online_model import OnlineCostModel  # noqa: E402
from tests.test_online_model import IDENTITY, CountingProbe  # noqa: E402


def _durations(cache: str) -> np.ndarray:
    with open(sfs.cache_file(cache)) as f:
        return np.array([d for _, d, _ in json.load(f)["steps"]])


def test_variants_are_read_as_this_trees_cache_with_scaled_steps(tmp_path) -> None:
    fresh = str(tmp_path / "fresh")
    OnlineCostModel(cache=fresh).warm_start(IDENTITY, CountingProbe())
    other = tmp_path / "other.json"
    other_steps = [[[1.0] * 9, 0.5, "decode"]]
    other.write_text(json.dumps({"steps": other_steps}))
    caches = sfs.variants(fresh, str(tmp_path / "out"), str(other))
    assert list(caches) == ["fresh", "2x slow", "2x fast", "other"]
    base = _durations(fresh)
    for name, factor in (("2x slow", 2.0), ("2x fast", 0.5)):
        assert np.allclose(_durations(caches[name]), factor * base)
        model = OnlineCostModel(cache=caches[name])
        assert model.warm_start(IDENTITY, CountingProbe()).startswith("cached")
    assert _durations(caches["other"]).tolist() == [0.5]
    assert os.path.basename(sfs.cache_file(caches["other"])) == os.path.basename(
        sfs.cache_file(fresh))


def test_table_reports_medians_per_warm_start() -> None:
    runs = {"fresh": [{"request_throughput": r, "median_itl_ms": 40.0, "p99_itl_ms": 250.0,
                       "slow_steps": s} for r, s in ((1.2, 1), (1.4, 3), (1.3, 2))]}
    assert "| fresh | 1.300 | 40 | 250 | 2 |" in sfs.table(runs)


@pytest.mark.parametrize("content", [None, "{}", '{"steps": []}', "not json"])
def test_a_bad_other_cache_is_refused_before_serving(tmp_path, content, capsys) -> None:
    path = tmp_path / "other.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        sfs.check_cache_file(argparse.ArgumentParser(prog="stale_fit_served.py"), str(path))
    assert e.value.code == 2
    assert "not a step-model cache file" in capsys.readouterr().err
