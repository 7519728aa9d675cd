"""Command-line flags for the engine, spelled as vLLM spells them, mapped onto EngineConfig."""
from __future__ import annotations

import argparse
from typing import Any

from chunkserve.config import (
    ATTENTION_BACKENDS,
    CHUNK_POLICIES,
    DEFAULT_MIN_CHUNK_TOKENS,
    DEFAULT_TARGET_ITL_MS,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    NO_CHUNK_SCHEDULERS,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULERS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from chunkserve.engine.trace import TRACE_FORMATS


def add_engine_args(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """The engine's flags (vLLM's names), grouped as `--help` shows them."""
    _add_model_args(p, model_flag)
    _add_parallel_args(p)
    _add_scheduling_args(p.add_argument_group("scheduling"))
    _add_cache_args(p.add_argument_group("KV cache"))
    p.add_argument("--trace-file", default=None,
                   help="write the step trace there: one JSON line per engine step, or a "
                        "Perfetto timeline for a .json file (docs/trace.md)")
    p.add_argument("--trace-format", choices=TRACE_FORMATS, default=None,
                   help="jsonl or perfetto (ui.perfetto.dev, chrome://tracing); default: "
                        "perfetto for a .json --trace-file, else jsonl")


def _add_model_args(p: argparse.ArgumentParser, model_flag: bool) -> None:
    if model_flag:
        p.add_argument("--model", default="smollm2-135m",
                       help="'smollm2-135m', a .gguf file or a HF folder (config.json + safetensors)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: bfloat16 on CPUs with AVX512_BF16, else float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: cuda when torch sees a GPU (untested here: no GPU), else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights of the model's shape (a preset such as "
                        "llama-3-8b always is)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: triton on CUDA; on the CPU cpu (C kernels), or torch where they "
                        "do not build")
    p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default="auto",
                   help="CPU weight-only formats. int8: groups of 32 with a scale (GGUF's Q8_0) "
                        "on CPUs with AVX512_BF16, else one scale per output channel; int4: "
                        "groups of 32 with scale and minimum (GGUF's Q4_1 block); auto (with "
                        "--dtype auto): int4 for weights that already are 4-bit, on CPUs with "
                        "AVX512_BF16, else int8")
    p.add_argument("--enforce-eager", action="store_true",
                   help="decode steps op by op: no CUDA graphs on a GPU, no fused decode "
                        "step (every layer in one C call) on a CPU")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that each hold a shard of every layer (processes on this "
                        "machine, gloo on the CPU; the cores are split among them). The "
                        "model's query heads, KV heads (or the ranks, a multiple of them) and "
                        "MLP size must divide by it")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines the --tensor-parallel-size ranks are spread over, evenly: "
                        "node k hosts ranks k*N/nnodes onwards; with `serve "
                        "--data-parallel-size`, the engines instead (docs/parallel.md)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's node: 0 runs the engine (and the server); the others "
                        "run only their ranks or engines (headless), with node 0's engine "
                        "flags")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address, reachable from every node (default %(default)s)")
    p.add_argument("--master-port", type=int, default=0,
                   help="the port node 0 listens on for the other nodes (rank 0's store, or "
                        "the server's with --data-parallel-size); needed with --nnodes > 1")


def _add_scheduling_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget (the chunk size); default 2048 when chunking")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--scheduler", choices=SCHEDULERS, default=None,
                   help="default: decode-first when chunking, prefill-first otherwise")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    add_chunk_policy_args(g)
    add_cost_model_arg(g)


def _add_cache_args(c: argparse._ArgumentGroup) -> None:
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--kv-cache-memory", type=float, default=None, help="GiB (default 2)")
    c.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-cache-memory")
    c.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    c.add_argument("--swap-space", type=float, default=4.0, help="GiB of host swap (swap mode)")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of full blocks shared with earlier prompts (vLLM V1: on)")
    c.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto: the model's dtype; bfloat16: two bytes a value (under a "
                        "float32 model, as on CPUs without AVX512_BF16: twice the tokens, half "
                        "the attention reads); fp8 (= fp8_e4m3) or fp8_e5m2: one byte a "
                        "value, unscaled (less accurate); narrower than the model's dtype: cpu "
                        "and torch attention backends")
    c.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for all layers: sliding-window layers keep every "
                        "block instead of freeing what left their window (vLLM's flag)")


def add_chunk_policy_args(p: argparse._ActionsContainer) -> None:
    """The adaptive chunk policy's flags, shared by the engine, the server, sim and bench sweep."""
    p.add_argument("--chunk-policy", choices=CHUNK_POLICIES, default=None,
                   help="static: every step's budget is --max-num-batched-tokens; adaptive: each "
                        "step's prefill chunk is sized so the predicted step time stays under "
                        "--target-itl-ms (--max-num-batched-tokens is then the cap, default the "
                        "model's context). Default: adaptive for `serve` unless "
                        "--max-num-batched-tokens is given or chunking is off; static offline")
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help=f"adaptive: predicted step time (= decode token gap) to stay under "
                        f"(default {DEFAULT_TARGET_ITL_MS:g})")
    p.add_argument("--min-chunk-tokens", type=int, default=DEFAULT_MIN_CHUNK_TOKENS,
                   help="adaptive: the smallest prefill chunk, so prefill always progresses")


def default_chunk_policy(args: argparse.Namespace, serving: bool) -> str:
    """--chunk-policy when it was not given. A server with no --max-num-batched-tokens runs
    the adaptive policy on the engine's own step-time model (no knob to turn); an explicit
    budget keeps the static policy exactly, as in vLLM; offline runs (`generate`, `LLM`) keep
    the static throughput default. A --target-itl-ms asks for the adaptive policy anywhere."""
    if args.chunk_policy is not None:
        return args.chunk_policy
    if args.target_itl_ms is not None:
        return "adaptive"
    chunking = (args.enable_chunked_prefill is not False
                and args.scheduler not in NO_CHUNK_SCHEDULERS)
    auto = serving and chunking and args.max_num_batched_tokens is None
    return "adaptive" if auto else "static"


def add_cost_model_arg(p: argparse._ActionsContainer) -> None:
    """Where a real engine's adaptive policy gets its step-time model (the simulator has one)."""
    p.add_argument("--cost-model", default=None,
                   help="adaptive: a fixed step-time model, a `chunkserve profile` file or a "
                        "hardware preset (a100-80gb, ...); default: the engine's own, probed at "
                        "start (cached in ~/.cache/chunkserve) and refit while serving")


ENGINE_KEYS = (
    "model", "dtype", "device", "max_model_len", "seed", "load_format", "attention_backend",
    "enforce_eager", "quantization", "enable_chunked_prefill",
    "max_num_batched_tokens", "max_num_seqs", "scheduler", "long_prefill_token_threshold",
    "scheduling_policy", "block_size", "kv_cache_memory", "num_kv_blocks", "preemption_mode",
    "swap_space", "trace_file", "trace_format", "enable_prefix_caching", "kv_cache_dtype", "chunk_policy",
    "target_itl_ms", "min_chunk_tokens", "disable_hybrid_kv_cache_manager",
    "tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port",
    "data_parallel_size",  # `serve` only (its server flags)
    # Not a flag: the adaptive policy's step-time model, which the command line builds from
    # --cost-model (cli.py; the engine cannot import the simulator's cost models).
    "step_time",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs(args))
