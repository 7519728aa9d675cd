"""From a model name to a ready model: resolve, load weights and tokenizer, pick the dtype."""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from chunkserve.config import ModelConfig
from chunkserve.model.attention.select import make_attention_backend
from chunkserve.model.kernels import cpu_library
from chunkserve.model.layers import group_gemm, quant_linear
from chunkserve.model.layers.layer_ops import make_layer_ops
from chunkserve.model.loaders.source import load_source
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.llama import LlamaForCausalLM
from chunkserve.model.models.registry import architecture
from chunkserve.model.parallel import check_tp_size, shard_config, shard_weights, tp_shard
from chunkserve.model.tp_layers import Collectives, parallelize
from chunkserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: str
    config: DecoderConfig
    model: LlamaForCausalLM  # or a variant (models/registry.py)
    tokenizer: Tokenizer
    max_model_len: int


# Whether `--quantization auto` turns int8 on for the CPU. Measured (docs/performance.md, issue
# 11) on an AVX2 EPYC, float32 activations: int8 decode steps 2.1x faster at B=1, 1.3x at B=16,
# on par (within 3%) at B=32 and 64; and on an AVX512_BF16 EPYC, bfloat16 activations: the
# layer's GEMMs 2.6x faster at one row, 1.6x at four, on par at 16. Prefill is unchanged on
# both (its rows use the dense copy).
INT8_BY_DEFAULT = True


# The KV cache under `--dtype auto` where that means float32 activations (a CPU without
# AVX512_BF16, which emulates bf16 GEMMs slower than fp32 ones): still 16 bits a value, as it is
# on every other machine (and as llama.cpp's default f16 cache is). Storage only, the arithmetic
# stays float32; half the bytes each decode reads, twice the tokens in the same memory. On a
# Zen 3 (2 cores, AVX2) the capacity beside llama-server went from 2.82x to 2.97x
# (docs/performance.md, issue 33).
AUTO_CPU_KV_DTYPE = torch.bfloat16


@lru_cache(maxsize=1)
def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU has native bf16 dot products (False under CHUNKSERVE_CPU_ISA=avx2: the
    engine then chooses as on an AVX2-only CPU)."""
    if cpu_library.isa() == "avx2":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


def resolve_device(name: str | torch.device) -> torch.device:
    if isinstance(name, torch.device):  # already placed (a tensor-parallel rank's cuda:N)
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but this torch build sees no CUDA GPU")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if name == "auto" and device is not None and device.type == "cuda":
        return torch.bfloat16
    if name == "auto":
        # Without native bf16 dot products a CPU emulates bf16 GEMMs slower than fp32 ones.
        return torch.bfloat16 if cpu_has_avx512_bf16() else torch.float32
    raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}")


def resolve_quantization(name: str, dtype: str, device: torch.device) -> str | None:
    """None (dense weights), "int8", "int4" or "auto" (per linear: int4 where the weights are
    already 4-bit, else int8; see make_linear). `auto` quantizes on the CPU when the dtype is
    left to auto as well (an explicit dtype means the caller wants that precision); int4 only
    where it was measured faster: where one of our group GEMMs runs (AVX2 or AVX512_BF16)."""
    if name == "none":
        return None
    if name in ("int8", "int4"):
        if device.type != "cpu":
            raise ValueError(f"quantization {name!r} runs on the CPU only; use --device cpu")
        return name
    if name == "auto":
        if not (device.type == "cpu" and dtype == "auto" and INT8_BY_DEFAULT):
            return None
        return "auto" if group_gemm.available() is not None else "int8"
    raise ValueError(f"quantization must be auto, int4, int8 or none, got {name!r}")


def load_model(
    name: str,
    dtype: str = "auto",
    max_model_len: int | None = None,
    device: str | torch.device = "auto",
    *,
    load_format: str = "auto",
    attention_backend: str = "auto",
    seed: int = 0,
    quantization: str = "auto",
    tp_group: Collectives | None = None,
) -> LoadedModel:
    """`name` is the default model, a .gguf file, a HF folder or a model preset (random weights).

    `load_format="dummy"` keeps the named model's config and tokenizer but draws random weights
    (seeded), built directly on the device in the compute dtype, so no weights are read.
    `tp_group`: a tensor-parallel rank's collectives; the model is then built from the rank's
    shard of the weights (model/parallel.py) and wrapped with them (model/tp_layers.py).
    The returned config is the whole model's either way.
    """
    dev = resolve_device(device)
    quant = resolve_quantization(quantization, dtype, dev)
    torch_dtype = resolve_dtype(dtype, dev)
    path, config, weights, tokenizer = load_source(name, load_format, seed, dev, torch_dtype)
    limit = config.max_position_embeddings
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        why = ("" if config.sliding_window != limit else
               ", capped at its sliding attention window: its layers do not say which slide")
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the model's context length "
            f"({limit}{why})."
        )
    arch = architecture(config.architecture)
    local, shard = config, None
    if tp_group is not None and tp_group.world_size > 1:
        check_tp_size(config, tp_group.world_size, name)
        shard = tp_shard(config, tp_group.world_size, tp_group.rank)
        local = shard_config(config, tp_group.world_size, tp_group.rank)
        weights = shard_weights(weights, config, arch, tp_group.world_size, tp_group.rank)
    attention = make_attention_backend(attention_backend, local.num_attention_heads,
                                       local.num_key_value_heads, local.head_dim, dev)
    skipped_before = quant_linear.dense_copies_skipped()
    model = arch(local, weights, torch_dtype, max_positions=max_model_len, attention=attention,
                 device=dev, quantization=quant, ops=make_layer_ops(dev))
    skipped = quant_linear.dense_copies_skipped() - skipped_before
    if skipped:
        logger.warning("%d linears keep no dense %s copy for prefill rows: this machine would "
                       "have had under %.0f GiB available after them. Their prefill chunks run "
                       "through the quantized kernel (slower); decode is unchanged.", skipped,
                       str(torch_dtype).removeprefix("torch."),
                       quant_linear.DENSE_RESERVE_BYTES / quant_linear.GiB)
    if shard is not None:
        parallelize(model, tp_group, shard)  # type: ignore[arg-type]
    if dtype == "auto" and torch_dtype == torch.float32 and model.attn.supports_narrow_kv_cache:
        model.kv_dtype = AUTO_CPU_KV_DTYPE
        logger.info("--dtype auto: float32 activations (this CPU has no AVX512_BF16) over a "
                    "%s KV cache; --dtype float32 keeps a float32 one",
                    str(AUTO_CPU_KV_DTYPE).removeprefix("torch."))
    if quant is not None:
        logger.info("weights %s (quantization %s, %s activations): %s", name, quantization,
                    str(torch_dtype).removeprefix("torch."), weight_formats(model))
    return LoadedModel(path, config, model, tokenizer, max_model_len)


def weight_formats(model: LlamaForCausalLM) -> str:
    """Which kernel multiplies how many linears, e.g. "int4 on the avx2 group GEMM: 120; int8
    on the avx2 group GEMM: 1": what `auto` picked on this CPU, for the log."""
    linears = [x for layer in [*model.layers, model] for x in vars(layer).values()
               if hasattr(x, "weight_bytes") and hasattr(x, "shape")]
    counts = collections.Counter(_format_name(x) for x in linears)
    return "; ".join(f"{k}: {n}" for k, n in counts.items())


def _format_name(linear: object) -> str:
    kernel = getattr(linear, "kernel", None)
    if kernel is None:
        return "dense"
    bits = "int4" if type(linear).__name__ == "Int4Linear" else "int8"
    if isinstance(kernel, group_gemm.GroupGemm):
        return f"{bits} on the {kernel.kernel.name} group GEMM"
    return f"{bits} on PyTorch's {type(kernel).__name__}"


def load_configured(mc: ModelConfig, tp_group: Collectives | None = None,
                    device: torch.device | None = None) -> LoadedModel:
    """The model an engine's ModelConfig names (the engine, and every tensor-parallel rank;
    `device`: the rank's own, cuda:N on a node of several GPUs)."""
    return load_model(mc.model, mc.dtype, mc.max_model_len, device or mc.device,
                      load_format=mc.load_format, attention_backend=mc.attention_backend,
                      seed=mc.seed, quantization=mc.quantization, tp_group=tp_group)
