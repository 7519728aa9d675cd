"""The one configuration module: dataclasses whose field names match vLLM's flags.

A leaf module (imports nothing from chunkserve) so that `core/` can take its config from here
without pointing an arrow upwards.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

CHUNKED_SCHEDULERS = ("decode-first", "vllm-v1")
NO_CHUNK_SCHEDULERS = ("prefill-first", "orca")
SCHEDULERS = CHUNKED_SCHEDULERS + NO_CHUNK_SCHEDULERS
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
# static: every step's budget is max_num_batched_tokens; adaptive: each step's prefill chunk is
# sized from a step-time model to keep the step under target_itl_ms (core/chunk_budget.py).
CHUNK_POLICIES = ("static", "adaptive")
DEFAULT_MIN_CHUNK_TOKENS = 32
# adaptive without --target-itl-ms: the token gap the policy holds (docs/performance.md,
# "No knob to turn", says how it was chosen). Below the machine's decode-only step it degrades
# to the smallest chunk with a warning, where an explicit target too low is an error.
DEFAULT_TARGET_ITL_MS = 250.0


def target_itl_ms_or_default(target_itl_ms: float | None) -> float:
    """The adaptive policy's token-gap target in ms: the one given, else the default."""
    return DEFAULT_TARGET_ITL_MS if target_itl_ms is None else target_itl_ms
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights from the model's config (vLLM's name)
# auto: triton on CUDA, cpu on the CPU (torch: the per-request SDPA reference, any device)
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
# auto (with --dtype auto, on the CPU): int4 for weights that already are 4-bit (a Q4 GGUF) on
# CPUs with AVX512_BF16, else int8; none: the dtype's dense weights.
QUANTIZATIONS = ("auto", "int4", "int8", "none")
# vLLM's --kv-cache-dtype: auto = the model's dtype (bfloat16 where --dtype auto runs float32
# activations on a CPU without AVX512_BF16: model/factory.py's AUTO_CPU_KV_DTYPE); bfloat16;
# fp8 = fp8_e4m3 (one byte a value, half of bfloat16's K/V bytes: twice the tokens in the same
# memory, half the reads of decode attention).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "bfloat16", *FP8_KV_CACHE_DTYPES)

# vLLM's server default budget; also the article's "balanced" setting.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto: bfloat16 linears where the CPU has AVX512_BF16, else float32
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    load_format: str = "auto"  # auto: the weights at `model`; dummy: random ones of its shape
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs, no fused CPU decode step (vLLM's flag)
    quantization: str = "auto"

    def verify(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB; None: DEFAULT_KV_CACHE_GIB
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    preemption_mode: str = "recompute"
    # vLLM V1's automatic prefix caching, on by default as there.
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    # vLLM's flag: one block table for every layer, sliding-window layers keeping all their
    # KV as full-attention layers do (masked, not freed). The baseline the groups are
    # measured against.
    disable_hybrid_kv_cache_manager: bool = False

    def verify(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive (GiB), got {self.kv_cache_memory}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative (GiB), got {self.swap_space}.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}."
            )


DEFAULT_KV_CACHE_GIB = 2.0


@dataclass(frozen=True)
class ParallelConfig:
    # vLLM's -tp: ranks that each hold a shard of every layer (engine/tp/executor.py).
    tensor_parallel_size: int = 1
    # vLLM's multi-node flags. With one engine the ranks split evenly over `nnodes` machines,
    # node k hosting ranks k*L .. k*L+L-1 (L = ranks_per_node). Node 0 runs the engine and rank
    # 0, whose store listens at master_addr:master_port; the other nodes run only their ranks
    # (engine/tp/headless.py). With data_parallel_size > 1 the *engines* split over the nodes instead,
    # each with its tensor-parallel ranks on its own node (engine/dp_headless.py).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port, which only node 0 itself can then know
    # vLLM's -dp: whole engines behind one API server (`serve` only: frontend/engines.py).
    data_parallel_size: int = 1

    @property
    def ranks_per_node(self) -> int:
        if self.data_parallel_size > 1:
            return self.tensor_parallel_size  # an engine's ranks never leave its node
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The ranks this node hosts (one engine over several nodes)."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def node_engines(self) -> range:
        """The data-parallel engines this node hosts: node k the k-th equal run of them."""
        per = self.data_parallel_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def one_engine(self) -> ParallelConfig:
        """What one data-parallel engine runs with: its own tensor-parallel group on its own
        node, whose store takes a free port (the multi-node flags are the server's)."""
        return replace(self, data_parallel_size=1, nnodes=1, node_rank=0,
                       master_addr="127.0.0.1", master_port=0)

    def verify(self) -> None:
        tp, dp, nnodes = self.tensor_parallel_size, self.data_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}.")
        if dp < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {dp}.")
        if nnodes < 1:
            raise ValueError(f"nnodes (--nnodes) must be at least 1, got {nnodes}.")
        if dp > 1 and dp % nnodes:
            raise ValueError(f"--data-parallel-size {dp} must divide evenly by --nnodes "
                             f"{nnodes}: every node hosts the same number of engines.")
        if dp == 1 and tp % nnodes:
            raise ValueError(f"--tensor-parallel-size {tp} must divide evenly by --nnodes "
                             f"{nnodes}: every node hosts the same number of ranks.")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, "
                             f"got {self.node_rank}.")
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in [0, 65535], got {self.master_port}.")
        if nnodes > 1 and self.master_port == 0:
            raise ValueError(f"--nnodes {nnodes} needs an explicit --master-port: every node "
                             "must know where node 0 listens.")
        if dp > 1 and nnodes == 1 and self.master_port:
            raise ValueError("--master-port is where node 0 listens for the other nodes' "
                             "engines: with --data-parallel-size on one node it has no use "
                             "(each engine's tensor-parallel group takes a free port).")
        if not self.master_addr:
            raise ValueError("--master-addr must not be empty.")
        if nnodes > 1 and self.master_addr in ("0.0.0.0", "::"):
            # The store listens on every interface anyway; this is where the others connect.
            raise ValueError(f"--master-addr {self.master_addr} is not an address other nodes "
                             "can connect to: give node 0's address on their network.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = None  # None: 2048 chunked, max_model_len otherwise
    max_num_seqs: int = 256
    max_model_len: int = 8192  # the model's, filled in by EngineConfig.resolve
    enable_chunked_prefill: bool | None = None  # None: follows `scheduler`
    scheduler: str | None = None  # None: decode-first if chunking, prefill-first if not
    long_prefill_token_threshold: int = 0  # 0: off
    scheduling_policy: str = "fcfs"
    chunk_policy: str = "static"
    target_itl_ms: float | None = None  # adaptive: the step time to stay under (None: default)
    min_chunk_tokens: int = DEFAULT_MIN_CHUNK_TOKENS  # adaptive: the chunk never goes below
    # adaptive: predicted seconds of a planned step (core.chunk_budget.StepTimeFn). A callable
    # rather than a name so that the scheduler stays pure: whoever builds the engine makes it
    # from a cost model (sim.step_cost: a `chunkserve profile` file or a hardware preset).
    step_time: Callable[[Any], float] | None = field(default=None, compare=False, repr=False)

    @property
    def chunked(self) -> bool:
        return self.scheduler in CHUNKED_SCHEDULERS

    @property
    def target_s(self) -> float:
        """adaptive: the token-gap target in seconds, the default when none was given."""
        return target_itl_ms_or_default(self.target_itl_ms) / 1e3

    @property
    def is_resolved(self) -> bool:
        """Every default that depends on another is filled in (what the scheduler asserts)."""
        return (self.scheduler in SCHEDULERS and self.enable_chunked_prefill is not None
                and self.max_num_batched_tokens is not None)

    def resolve(self, max_model_len: int | None = None) -> SchedulerConfig:
        """A copy with the defaults that depend on each other filled in, then verified.

        The one place where "no chunking → budget = max_model_len" is decided: a no-chunk
        policy must fit a whole max-length prompt in one step. The adaptive policy's cap is
        max_model_len too: its step-time model, not a fixed number, bounds each step.
        """
        max_len = self.max_model_len if max_model_len is None else max_model_len
        scheduler = self.scheduler
        if scheduler is None:
            scheduler = "prefill-first" if self.enable_chunked_prefill is False else "decode-first"
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}.")
        chunked = scheduler in CHUNKED_SCHEDULERS
        budget = self.max_num_batched_tokens
        if budget is None:
            fixed = chunked and self.chunk_policy != "adaptive"
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if fixed else max_len
        resolved = replace(
            self, scheduler=scheduler, max_model_len=max_len, max_num_batched_tokens=budget,
            enable_chunked_prefill=(chunked if self.enable_chunked_prefill is None
                                    else self.enable_chunked_prefill),
        )
        resolved.verify()
        return resolved

    def verify(self) -> None:
        assert self.is_resolved, "verify() checks a resolved config"
        if self.enable_chunked_prefill != self.chunked:
            raise ValueError(
                f"scheduler {self.scheduler!r} "
                f"{'always chunks' if self.chunked else 'never chunks'}; it cannot run with "
                f"enable_chunked_prefill={self.enable_chunked_prefill}."
            )
        budget, max_len = self.max_num_batched_tokens, self.max_model_len
        assert budget is not None
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {budget}.")
        if not self.chunked and budget < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than "
                f"max_model_len ({max_len}). Without chunked prefill a prompt must fit "
                "in one step, so this would refuse long prompts. Please increase "
                "max_num_batched_tokens, decrease max_model_len, or enable chunked prefill."
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}."
            )
        self._verify_chunk_policy()

    def _verify_chunk_policy(self) -> None:
        if self.chunk_policy not in CHUNK_POLICIES:
            raise ValueError(
                f"chunk_policy must be one of {CHUNK_POLICIES}, got {self.chunk_policy!r}."
            )
        if self.min_chunk_tokens < 1:
            raise ValueError(f"min_chunk_tokens must be positive, got {self.min_chunk_tokens}.")
        if self.chunk_policy == "static":
            if self.target_itl_ms is not None:
                raise ValueError("target_itl_ms needs chunk_policy 'adaptive' (--chunk-policy "
                                 "adaptive); the static policy has no target.")
            return
        if not self.chunked:
            raise ValueError(f"chunk_policy 'adaptive' sizes prefill chunks; scheduler "
                             f"{self.scheduler!r} never chunks. Use decode-first or vllm-v1.")
        if self.target_itl_ms is not None and not self.target_itl_ms > 0:
            raise ValueError(f"target_itl_ms (--target-itl-ms) must be positive, got "
                             f"{self.target_itl_ms}.")
        if self.step_time is None:
            raise ValueError("chunk_policy 'adaptive' needs a step-time model (step_time: "
                             "chunkserve.sim.step_cost.step_time_kwargs builds one, the online "
                             "model by default; on the command line, --cost-model).")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace_file: str | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    trace_format: str | None = None  # "jsonl" or "perfetto"; None: by trace_file's suffix

    def portable(self) -> EngineConfig:
        """This config as plain data, for another process (engine/tp/step_wire.py, the
        data-parallel rendezvous): without `step_time`, a callable that the engine process
        makes its own from the same flags."""
        return replace(self, scheduler_config=replace(self.scheduler_config, step_time=None))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Spreads flat vLLM-style keyword arguments over the sub-configs by field name."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {},
                                            "parallel": {}}
        owners = {
            "model": {f.name for f in fields(ModelConfig)},
            "cache": {f.name for f in fields(CacheConfig)},
            "parallel": {f.name for f in fields(ParallelConfig)},
            # max_model_len belongs to the model config; resolve() copies it across.
            "scheduler": {f.name for f in fields(SchedulerConfig)} - {"max_model_len"},
        }
        trace_file = kwargs.pop("trace_file", None)
        trace_format = kwargs.pop("trace_format", None)
        for key, value in kwargs.items():
            owner = next((name for name, keys in owners.items() if key in keys), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            parts[owner][key] = value
        config = cls(
            ModelConfig(**parts["model"]),
            CacheConfig(**parts["cache"]),
            SchedulerConfig(**parts["scheduler"]),
            trace_file,
            ParallelConfig(**parts["parallel"]),
            trace_format,
        )
        config.model_config.verify()
        config.cache_config.verify()
        config.parallel_config.verify()
        return config

    def resolve(
        self, model_max_len: int, device: str | None = None, dtype: str | None = None
    ) -> EngineConfig:
        """The frozen, verified config an engine runs with: `max_model_len` from the model when
        not set (never above it), the scheduler's dependent defaults, and the device and dtype
        the model was actually loaded with (what "auto" became)."""
        mc = self.model_config
        if mc.max_model_len is not None and mc.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({mc.max_model_len}) exceeds the model's ({model_max_len})"
            )
        max_len = mc.max_model_len or model_max_len
        model = replace(mc, max_model_len=max_len, device=device or mc.device,
                        dtype=dtype or mc.dtype)
        return replace(self, model_config=model,
                       scheduler_config=self.scheduler_config.resolve(max_len))

    @property
    def max_model_len(self) -> int:
        max_len = self.model_config.max_model_len
        assert max_len is not None, "resolve() the config first"
        return max_len
