"""Engine steps of several CPU configurations, measured alternately in one process.

Weights format (`--quantization`), attention backend and KV cache dtype (`--kv-cache-dtype`)
change a step's time by less than this machine's drift between two runs, so every
configuration is loaded side by side and each measurement round visits them in alternating
order; the table gives medians per configuration.

    .venv/bin/python benchmarks/engine/cpu_configs.py --batches 1,16,32,64 --context 256
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.model.factory import load_model
from chunkserve.sampling_params import SamplingParams

# The repository root, so that `benchmarks.*` imports when this file runs as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common.host import cpu_info  # noqa: E402

CONFIGS = {
    "fp32/torch": dict(dtype="float32", quantization="none", attention_backend="torch"),
    "int8/torch": dict(dtype="float32", quantization="int8", attention_backend="torch"),
    "int8/cpu": dict(dtype="float32", quantization="int8", attention_backend="cpu"),
    "fp32/cpu": dict(dtype="float32", quantization="none", attention_backend="cpu"),
    "bf16/torch": dict(dtype="bfloat16", quantization="none", attention_backend="torch"),
    "bf16/cpu": dict(dtype="bfloat16", quantization="none", attention_backend="cpu"),
    # The defaults (`make serve`), and with an fp8 KV cache.
    "auto/cpu": dict(dtype="auto", quantization="auto", attention_backend="cpu"),
    "auto/cpu/fp8": dict(dtype="auto", quantization="auto", attention_backend="cpu",
                         kv_cache_dtype="fp8"),
    "auto/cpu/fp8_e5m2": dict(dtype="auto", quantization="auto", attention_backend="cpu",
                              kv_cache_dtype="fp8_e5m2"),
}


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def timed(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def rounds(engines: dict[str, LLMEngine], n: int, measure) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median of `measure(engine, round)` per configuration, alternating the visiting order."""
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(n):
        order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
        for name, engine in order:
            times[name].append(measure(engine, r))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def prefill(engine: LLMEngine, r: int, n: int) -> float:
    engine.add_request(None, [100 + (i * 7 + r) % 40000 for i in range(n)], params(1))
    return timed(engine)


def decode_batch(engines: dict[str, LLMEngine], b: int, context: int) -> dict[str, float]:
    ids = {}
    for name, e in engines.items():
        prompts = [[100 + (i * 11 + j) % 40000 for i in range(context)] for j in range(b)]
        ids[name] = [e.add_request(None, p, params(1000)) for p in prompts]
        while e.step().record.num_prefill_tokens:  # until every prompt is in the cache
            pass
    result = rounds(engines, 6, lambda e, r: statistics.median(timed(e) for _ in range(3)))
    for name, e in engines.items():
        e.abort_request(ids[name])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="fp32/torch,int8/torch,int8/cpu")
    p.add_argument("--batches", default="1,16,32,64")
    p.add_argument("--context", type=int, default=256)
    args = p.parse_args()
    info = cpu_info()
    print(f"CPU: {info['model']}, {info['cores']} cores, {' '.join(info['flags'])}", flush=True)
    engines = {}
    for name in args.configs.split(","):
        config = dict(CONFIGS[name])
        kv_cache_dtype = config.pop("kv_cache_dtype", "auto")  # the engine's, not the model's
        loaded = load_model("smollm2-135m", max_model_len=args.context + 1024, **config)
        # No prefix caching: the prefill prompts of one round share their first tokens.
        engines[name] = LLMEngine.from_kwargs(loaded=loaded, max_num_batched_tokens=2048,
                                              num_kv_blocks=8192, enable_prefix_caching=False,
                                              kv_cache_dtype=kv_cache_dtype)
    print("| step (ms) | " + " | ".join(engines) + " |", flush=True)
    for n in (128, 512):
        row = rounds(engines, 5, lambda e, r: prefill(e, r, n))
        print(f"| prefill {n} | " + " | ".join(f"{v:.0f}" for v in row.values()) + " |", flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        row = decode_batch(engines, b, args.context)
        print(f"| decode B={b} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
