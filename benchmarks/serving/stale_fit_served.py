"""A wrong warm start of the engine's step-time model, served: what it costs, on this CPU.

`chunkserve serve` warm-starts its adaptive chunk policy from a probe cached per machine and
model (sim/online_model.py); this measures the served comparison's capacity phase
(compare_llama_server.py's: the mixed workload, seed 0, 48 requests, 16 at a time) with the
cache right and wrong. Each server gets its own $CHUNKSERVE_CACHE_DIR:

- `fresh`: the probe this tree runs here (the first server probes and caches it);
- `2x slow` / `2x fast`: that cache with every probed step's duration doubled / halved (the
  probe ran while the host was busier / quieter);
- `--other-cache FILE` (optional, `other`): another cache file's probed steps under this
  tree's key (e.g. one written with older kernels, from ~/.cache/chunkserve/step_model/).

Rounds alternate the warm starts (`--rounds`, medians reported); each server is started fresh
with `--trace-file`, so the report also counts the steps that ran past the token-gap target.

    .venv/bin/python benchmarks/serving/stale_fit_served.py --out DIR [--rounds 3]
        [--other-cache FILE]      # ~1 min per server on a 2-core Zen 3
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info  # noqa: E402
from benchmarks.common.report import save_report  # noqa: E402
from benchmarks.serving.compare_llama_server import measure  # noqa: E402

CAPACITY = ["--max-concurrency", "16", "--request-rate", "inf"]
TARGET_S = 0.250  # serve's default token-gap target
SLOW_STEP_S = 1.1 * TARGET_S


def cache_file(cache_dir: str) -> str:
    files = glob.glob(os.path.join(cache_dir, "step_model", "*.json"))
    if len(files) != 1:
        raise RuntimeError(f"expected one step-model cache file in {cache_dir}, found {files}")
    return files[0]


def write_variant(fresh_dir: str, out_dir: str, name: str,
                  steps: list[list[Any]]) -> str:
    """A cache folder holding the fresh cache's file (its key, its identity) with `steps`."""
    src = cache_file(fresh_dir)
    with open(src) as f:
        data = json.load(f)
    data["steps"] = steps
    folder = os.path.join(out_dir, "caches", name)
    os.makedirs(os.path.join(folder, "step_model"), exist_ok=True)
    with open(os.path.join(folder, "step_model", os.path.basename(src)), "w") as f:
        json.dump(data, f)
    return folder


def variants(fresh_dir: str, out_dir: str, other: str | None) -> dict[str, str]:
    """Warm start name -> its cache folder."""
    with open(cache_file(fresh_dir)) as f:
        steps = json.load(f)["steps"]
    found = {"fresh": fresh_dir}
    for name, factor in (("2x slow", 2.0), ("2x fast", 0.5)):
        scaled = [[x, d * factor, family] for x, d, family in steps]
        found[name] = write_variant(fresh_dir, out_dir, name.replace(" ", "-"), scaled)
    if other is not None:
        with open(other) as f:
            found["other"] = write_variant(fresh_dir, out_dir, "other", json.load(f)["steps"])
    return found


def check_cache_file(p: argparse.ArgumentParser, path: str) -> None:
    try:
        with open(path) as f:
            steps = json.load(f)["steps"]
        if not isinstance(steps, list) or not steps:
            raise ValueError("no probed steps")
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--other-cache {path}: not a step-model cache file ({e})")


def slow_steps(trace: str) -> int:
    with open(trace) as f:
        return sum(1 for line in f if json.loads(line)["duration"] > SLOW_STEP_S)


def serve_once(out_dir: str, name: str, cache: str) -> dict[str, Any]:
    os.environ["CHUNKSERVE_CACHE_DIR"] = cache  # the server inherits it
    trace = os.path.join(out_dir, f"{name}.trace.jsonl")
    result = measure("chunkserve", "", None, out_dir, name, CAPACITY, 48,
                     ["--trace-file", trace])
    result["slow_steps"] = slow_steps(trace)
    os.remove(trace)  # ~300 kB each; the counts are what the report keeps
    return result


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"| warm start | req/s | ITL p50 (ms) | ITL p99 (ms) | steps > "
             f"{SLOW_STEP_S * 1e3:.0f} ms |", "|---|---:|---:|---:|---:|"]
    for name, results in runs.items():
        def med(key: str) -> float:
            return float(np.median([r[key] for r in results]))
        lines.append(f"| {name} | {med('request_throughput'):.3f} | "
                     f"{med('median_itl_ms'):.0f} | {med('p99_itl_ms'):.0f} | "
                     f"{med('slow_steps'):.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--other-cache", default=None,
                   help="a step-model cache file whose probed steps to warm-start from")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.other_cache is not None:
        check_cache_file(p, args.other_cache)  # before minutes of serving, not after
    out = os.path.abspath(args.out)
    fresh_dir = os.path.join(out, "caches", "fresh")
    os.makedirs(fresh_dir, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"fresh": [serve_once(out, "probe", fresh_dir)]}
    caches = variants(fresh_dir, out, args.other_cache)
    for name in caches:
        runs.setdefault(name, [])
    for r in range(args.rounds):
        for name, cache in caches.items():
            if name == "fresh" and r == 0:
                continue  # the probing server's run is round 0's
            runs[name].append(serve_once(out, f"{name.replace(' ', '-')}-{r}", cache))
    cpu = cpu_info()
    text = (f"Capacity phase (mixed, 48 requests, 16 at a time) on {cpu['model']} "
            f"({cpu['cores']} cores; {' '.join(cpu['flags'])}), medians of {args.rounds} "
            f"rounds:\n\n" + table(runs))
    save_report(out, "stale_fit_served", {"cpu": cpu, "runs": runs}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
