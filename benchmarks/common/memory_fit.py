"""Whether a benchmark's engine fits in this machine's memory, asked before it is started.

At 1-8B a model no longer fits everywhere: an 8B GGUF at Q4_0 is 4.4 GiB as stored, and an HF
folder of it 15 GiB. Started anyway, such a run swaps or is killed by the OOM killer half-way,
which says nothing about why. So a benchmark adds up what each engine must hold and refuses,
naming the parts, when the sum is over what the kernel reports available (MemAvailable: free
memory plus the caches it can drop). chunkserve's dense copies for prefill rows (2 bytes a
weight in bfloat16) are not among the must-haves: it keeps only those that fit
(layers/quant_linear.py), and `dense_copy_note` says when some will not.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

GiB = 1 << 30
# Python, torch and its allocator, the tokenizer, a step's activations: what a 135M run of
# chunkserve holds besides weights and the KV pool was ~0.8 GiB; a margin on top.
OVERHEAD_BYTES = int(1.5 * GiB)


class DoesNotFit(SystemExit):
    """A SystemExit: the benchmark ends with its message, exit status 1, no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), as chunkserve's
    own dense-copy guard reads them."""
    from chunkserve.model.layers.quant_linear import mem_available as read

    have = read()
    if have is None:
        raise RuntimeError("/proc/meminfo has no MemAvailable line")
    return have


@dataclass(frozen=True)
class GgufSize:
    """What a GGUF file holds: bytes on disk and parameters, split by role."""

    file_bytes: int
    linear_params: int  # 2-D weights of the transformer blocks (q/k/v/o, MLP)
    other_params: int  # token embedding, output head, norms

    @classmethod
    def of(cls, path: str) -> GgufSize:
        from gguf import GGUFReader  # mmaps the file: the tensors are not read

        linear = other = 0
        for t in GGUFReader(path).tensors:
            count = int(t.n_elements)
            if t.name.startswith("blk.") and len(t.shape) == 2:
                linear += count
            else:
                other += count
        return cls(os.path.getsize(path), linear, other)


def kv_bytes_per_token(path: str) -> int:
    """A 16-bit K/V cache's bytes per token of the GGUF's model (llama.cpp's f16 default,
    chunkserve's bf16): layers x K and V x kv heads x head_dim x 2 bytes."""
    from chunkserve.model.loaders.gguf import read_gguf_config

    c = read_gguf_config(path)
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2


def dense_copy_bytes() -> int:
    """Bytes per linear weight of the dense copy chunkserve's quantized linears keep here: the
    bf16 kernel hands prefill rows to a dense bf16 GEMM (a copy); the vnni and avx2 kernels
    take every row count themselves (none). No group GEMM at all: int8 through PyTorch, dense
    float32."""
    from chunkserve.model.layers import group_gemm, linear_int4

    kernel = group_gemm.available()
    if kernel is None:
        return 4
    return 0 if linear_int4.C_KERNEL_MAX_ROWS[kernel.name] is None else 2


def chunkserve_gguf_parts(path: str, kv_bytes: int) -> dict[str, int]:
    """What `chunkserve serve --model PATH` must hold (defaults: quantized linears from the
    file's blocks, a KV pool of `kv_bytes`)."""
    size = GgufSize.of(path)
    return {"weights as stored": size.file_bytes,
            # The embedding is gathered from a dense copy in the compute dtype.
            "embedding, head, norms (bf16)": size.other_params * 2,
            "KV pool": kv_bytes, "runtime": OVERHEAD_BYTES}


def dense_copy_note(path: str, parts: Mapping[str, int], available: int | None = None) -> str:
    """A line saying whether chunkserve's dense copies for prefill will all fit beside `parts`
    ("" where none are kept on this CPU)."""
    want = GgufSize.of(path).linear_params * dense_copy_bytes()
    if not want:
        return ""
    room = (mem_available() if available is None else available) - sum(parts.values())
    if want <= room:
        return f"chunkserve: dense copies for prefill rows, {want / GiB:.1f} GiB, fit"
    return (f"chunkserve: dense copies for prefill rows would need {want / GiB:.1f} GiB, "
            f"{max(room, 0) / GiB:.1f} GiB are left: it keeps those that fit, and the other "
            "layers' prefill rows run through the quantized kernel (slower prefill)")


def llama_cpp_parts(path: str, kv_bytes: int) -> dict[str, int]:
    """What llama.cpp holds for the file: its mmapped weights and its f16 KV cache."""
    return {"weights (mmapped)": os.path.getsize(path), "KV cache": kv_bytes,
            "runtime": OVERHEAD_BYTES // 3}


def require_fit(what: str, parts: Mapping[str, int], available: int | None = None) -> None:
    """Raises DoesNotFit, naming every part, when `parts` add up to more than `available`
    (default: MemAvailable now)."""
    have = mem_available() if available is None else available
    need = sum(parts.values())
    if need <= have:
        return
    detail = ", ".join(f"{name} {size / GiB:.1f}" for name, size in parts.items() if size)
    raise DoesNotFit(
        f"{what} needs about {need / GiB:.1f} GiB ({detail}) but this machine has "
        f"{have / GiB:.1f} GiB available (MemAvailable); a smaller model or quantization, or a "
        "smaller KV cache, would fit.")
