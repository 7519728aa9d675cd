"""Is this working tree slower than a baseline commit? Both engines in one process, interleaved.

On a shared machine whose speed drifts by 2x between runs, two separate benchmark runs cannot
show a 5% difference. Here the baseline commit's package is exported under another name
(`chunkserve_base`), both engines load the same model, and every measurement alternates
between them step by step (the order flips each round), so both see the same machine. The
result is the median of per-pair time ratios (this tree / baseline) for each step shape.

    .venv/bin/python benchmarks/engine/ab_speed.py --baseline HEAD [--rounds 7] [--dtype float32]

Prints the CPU model and flags, then one line per shape: median ms of each and the ratio.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFILL_SIZES = (128, 512)
DECODE_BATCHES = (1, 8, 32, 64)
CONTEXT = 512


def export_baseline(rev: str, dest: str) -> None:
    """`git archive` of the baseline's package, renamed to chunkserve_base (imports rewritten)."""
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "chunkserve"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    pkg = os.path.join(dest, "chunkserve_base")
    shutil.move(os.path.join(dest, "chunkserve"), pkg)
    pattern = re.compile(r"\bchunkserve(?=[.\s])")
    for root, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(pattern.sub("chunkserve_base", text))


def cpu_line() -> str:
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"model name\s*:\s*(.*)", info)
    flags = re.search(r"flags\s*:\s*(.*)", info)
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    have = [f for f in wanted if flags and f in flags.group(1).split()]
    return f"{model.group(1) if model else 'unknown CPU'}; flags: {' '.join(have)}"


class Side:
    """One version's engine, driven by wall-clock-timed steps."""

    def __init__(self, pkg: str, dtype: str) -> None:
        engine_mod: ModuleType = importlib.import_module(f"{pkg}.engine.llm_engine")
        factory = importlib.import_module(f"{pkg}.model.factory")
        self.params_mod = importlib.import_module(f"{pkg}.sampling_params")
        loaded = factory.load_model("smollm2-135m", dtype, max_model_len=CONTEXT + 1024)
        self.engine = engine_mod.LLMEngine.from_kwargs(
            loaded=loaded, max_num_batched_tokens=2048, num_kv_blocks=4096, block_size=16)
        self.name = pkg
        self.ids: list[str] = []

    def params(self, max_tokens: int) -> Any:
        return self.params_mod.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                              ignore_eos=True)

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0

    def prefill(self, n: int, salt: int) -> float:
        """A request of n tokens and max_tokens=1 (one step), timed."""
        prompt = [100 + (i * 7 + salt * 13) % 40000 for i in range(n)]
        self.engine.add_request(None, prompt, self.params(1))
        seconds = self.timed_step()
        assert not self.engine.has_unfinished_requests()
        return seconds

    def start_decodes(self, batch: int) -> None:
        self.ids = [self.engine.add_request(None, [100 + (i * 11 + b) % 40000 for i in range(CONTEXT)],
                                            self.params(1000)) for b in range(batch)]
        while True:  # until the first step with no prefill left: all are decoding
            result = self.engine.step()
            # A StepResult carries its record; older versions kept it in engine.trace.
            last = getattr(result, "record", None) or self.engine.trace.records[-1]
            if last.num_prefill_tokens == 0 and last.num_decode_tokens == batch:
                break

    def stop_decodes(self) -> None:
        self.engine.abort_request(self.ids)
        self.ids = []


def alternate(sides: list[Side], fn: Any, rounds: int) -> list[list[float]]:
    """fn(side, round) for each side, order flipped every round; times per side."""
    times: list[list[float]] = [[] for _ in sides]
    for r in range(rounds):
        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            times[i].append(fn(sides[i], r))
    return times


def report(label: str, times: list[list[float]]) -> dict[str, float]:
    base, new = times
    ratio = statistics.median(n / b for b, n in zip(base, new))
    row = {"baseline_ms": statistics.median(base) * 1e3, "new_ms": statistics.median(new) * 1e3,
           "ratio": ratio}
    print(f"| {label} | {row['baseline_ms']:.1f} | {row['new_ms']:.1f} | {ratio:.3f} |",
          flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--decode-steps", type=int, default=3, help="steps per side per round")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ab_speed_")
    export_baseline(args.baseline, tmp)
    sys.path.insert(0, tmp)
    print(cpu_line())
    sides = [Side("chunkserve_base", args.dtype), Side("chunkserve", args.dtype)]
    print(f"baseline {args.baseline} vs working tree, dtype {args.dtype}, {args.rounds} rounds\n")
    print("| step | baseline ms | this tree ms | ratio (median of pairs) |\n|---|---:|---:|---:|")
    for side in sides:  # warm both: first steps of a process run slow
        side.prefill(256, salt=99)
    for n in PREFILL_SIZES:
        report(f"prefill {n}", alternate(sides, lambda s, r, n=n: s.prefill(n, r), args.rounds))
    for b in DECODE_BATCHES:
        for side in sides:
            side.start_decodes(b)
        steps = args.decode_steps

        def decode(side: Side, _: int, steps: int = steps) -> float:
            return statistics.median(side.timed_step() for _ in range(steps))

        report(f"decode B={b}", alternate(sides, decode, args.rounds))
        for side in sides:
            side.stop_decodes()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
