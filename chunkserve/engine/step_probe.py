"""The start-up probe that warm-starts a learning step-time model (sim/online_model.py).

A handful of step shapes, run on a scratch engine over the loaded model before the serving
engine exists: fresh prefills of two sizes, a prompt in two chunks (the second attends to the
first's cached context), decode batches of one long request, eight short ones and 32 shorter ones, and a mixed step.
About 2,500 tokens in all: a few seconds on a 2-core CPU, a fraction of one on a GPU.

`probe_identity` says what the result depends on; the model caches its fit under that key, so
the probe runs once per machine, model, dtype and quantization.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from hashlib import sha256
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from chunkserve.config import CacheConfig, EngineConfig, SchedulerConfig
from chunkserve.core.chunk_budget import StepObservation
from chunkserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chunkserve.model.factory import LoadedModel


class _Engine(Protocol):
    """What the probe drives: an LLMEngine (not imported: llm_engine imports this module)."""

    def add_request(self, request_id: str | None, prompt: list[int],
                    params: SamplingParams) -> str: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> Any: ...
    def close(self) -> None: ...


def _chunkserve_version() -> str:
    try:
        return metadata.version("chunkserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _cpu_kernels() -> dict[str, str]:
    """The CPU kernels as built here: their sources change between versions, and
    CHUNKSERVE_CPU_ISA (with PyTorch's and oneDNN's own limits) runs another set of them on the
    same CPU."""
    from chunkserve.model.kernels import cpu_library

    return {"cpu_kernels": cpu_library.source_digest(),
            **{name.lower(): value for name, value in cpu_library.forced_isa().items()}}


# The scratch engine's token budget: a 768-token prompt runs as 512 fresh tokens, then 256 after
# them. Above cost_model.SMALL_GEMM_ROWS (256), so the fit can tell the per-token cost of large
# steps from the extra cost of small ones.
PROBE_BUDGET = 512
PROBE_TOKENS = 2048  # KV slots the scratch engine needs (the probe's requests all fit at once)


@lru_cache(maxsize=1)
def _cpu() -> tuple[str, str]:
    """The CPU's model name and a digest of its flags (AVX2 vs AVX512_BF16 changes everything)."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = value.strip()
                    break
    except OSError:
        pass
    return name, sha256(flags.encode()).hexdigest()[:12]


def probe_identity(loaded: LoadedModel, config: EngineConfig) -> dict[str, str]:
    """Everything a step's duration depends on besides its shape; `config` is resolved."""
    import torch

    mc, cc = config.model_config, config.cache_config
    cpu, flags = _cpu()
    identity = {
        "cpu": cpu, "cpu_flags": flags, "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "device": mc.device, "model": loaded.path, "load_format": mc.load_format,
        "dtype": mc.dtype, "quantization": mc.quantization, "kv_cache_dtype": cc.kv_cache_dtype,
        "attention_backend": mc.attention_backend, "block_size": str(cc.block_size),
        "enforce_eager": str(mc.enforce_eager), "torch": torch.__version__,
        # The probe's shapes shrink below this context (_probe_steps).
        "probe_context": str(min(config.max_model_len, PROBE_TOKENS)),
        "chunkserve": _chunkserve_version(),
    }
    if mc.device == "cuda":
        identity["gpu"] = torch.cuda.get_device_name()
    else:
        identity.update(_cpu_kernels())
    pc = config.parallel_config
    if pc.tensor_parallel_size > 1:  # (absent at 1: one process's cached fits stay valid)
        identity["tensor_parallel_size"] = str(pc.tensor_parallel_size)
        identity["nnodes"] = str(pc.nnodes)
    if os.path.exists(loaded.path):  # the same name with other weights is another model
        stat = os.stat(loaded.path)
        identity["model_file"] = f"{stat.st_size}:{int(stat.st_mtime)}"
    return identity


def run_probe(make_engine: Callable[[EngineConfig], _Engine], config: EngineConfig,
              vocab_size: int, num_kv_groups: int = 1) -> list[StepObservation]:
    """The probe's steps on a scratch engine that `make_engine` builds over the loaded model
    from the config given (a static budget, its own small KV pool: `num_kv_groups` tables per
    request draw from it)."""
    block = config.cache_config.block_size
    # Its own context is short: its KV pool must hold max_model_len tokens, and a 128k
    # context would make the probe allocate gigabytes for 2,048 tokens of work.
    max_len = min(config.max_model_len, PROBE_TOKENS)
    scratch = replace(
        config, trace_file=None,
        model_config=replace(config.model_config, max_model_len=max_len),
        # A short context shrinks the budget too, so the longest prompt still runs in two chunks.
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=min(PROBE_BUDGET, max(8, 2 * (max_len - 2) // 3)),
            max_num_seqs=64),
        cache_config=CacheConfig(block_size=block,
                                 num_kv_blocks=(PROBE_TOKENS // block + 16) * num_kv_groups,
                                 enable_prefix_caching=False,
                                 kv_cache_dtype=config.cache_config.kv_cache_dtype),
    )
    engine = make_engine(scratch)
    try:
        return _probe_steps(engine, vocab_size, max_len)
    finally:
        engine.close()


def _probe_steps(engine: _Engine, vocab_size: int, max_model_len: int
                 ) -> list[StepObservation]:
    def add(n: int, max_tokens: int, salt: int) -> None:
        # A short context shrinks the shapes: prompt + output must fit max_model_len.
        max_tokens = max(1, min(max_tokens, max_model_len - 1))
        n = max(1, min(n, max_model_len - max_tokens))
        # Distinct token ids per prompt: nothing shares a prefix (caching is off anyway).
        prompt = [100 + (7 * j + 13 * salt) % max(1, vocab_size - 200) for j in range(n)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"probe-{salt}", prompt, params)

    steps: list[StepObservation] = []

    def run(limit: int = 10_000) -> None:
        for _ in range(limit):
            if not engine.has_unfinished_requests():
                return
            result = engine.step()
            steps.append((result.scheduled, result.record.duration))

    add(3, 1, 0)  # warm-up: an engine's first step pays one-off allocation costs
    run()
    steps.clear()
    for salt, n in enumerate((32, 128), start=1):  # fresh prefills, one step each
        add(n, 1, salt)
        run()
    add(768, 1, 3)  # two chunks: the second attends to the first's 512 cached tokens
    run()
    add(384, 5, 4)  # one decode at a long context
    run()
    for salt in range(5, 13):  # a batch of eight decodes ...
        add(64, 6, salt)
    run(limit=4)
    add(128, 1, 13)  # ... and a prefill arriving among them: a mixed step
    run()
    for salt in range(14, 46):  # a batch of 32 short ones: per-request and sampling costs
        add(16, 4, salt)
    run()
    return steps
