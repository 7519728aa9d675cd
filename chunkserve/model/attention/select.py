"""Which attention backend a model runs with: `--attention-backend auto|cpu|torch|triton`."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from chunkserve.model.attention.backend import AttentionBackend
from chunkserve.model.attention.torch_backend import TorchPagedAttention

logger = logging.getLogger(__name__)


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (numpy on the CPU), for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton(device: torch.device) -> None:
    """Raises a ValueError that says why Triton kernels cannot run here, if they cannot."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError(
            "attention backend 'triton' needs the triton package, which is not installed "
            "(pip install triton), or use --attention-backend torch."
        )
    if device.type == "cpu" and not triton_interpreted():
        raise ValueError(
            "attention backend 'triton' runs on CUDA GPUs; on the CPU it runs only in Triton's "
            "interpreter (set TRITON_INTERPRET=1, slow: for tests). Use --attention-backend torch."
        )


def auto_backend(device: torch.device) -> str:
    """triton on a GPU that has it (it ships with CUDA builds of torch; without it a GPU still
    runs, just slower); on the CPU the batched C kernel when it builds here, else torch."""
    if device.type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    from chunkserve.model.kernels import cpu_library

    try:
        cpu_library.load()
    except cpu_library.KernelBuildError as e:
        logger.warning("%s Falling back to attention backend 'torch'.", e)
        return "torch"
    return "cpu"


def make_attention_backend(name: str, heads: int, kv_heads: int, head_dim: int,
                           device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = auto_backend(device)
    if name == "torch":
        return TorchPagedAttention(heads, kv_heads, head_dim)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention backend 'cpu' runs on the CPU; use triton or torch")
        # Imported here: building its kernel (a C compiler, cached on disk) is for CPU runs only.
        from chunkserve.model.attention.cpu_backend import CpuPagedAttention

        return CpuPagedAttention(heads, kv_heads, head_dim)
    if name == "triton":
        check_triton(device)
        # Imported only here: importing triton is slow and the CPU path never needs it.
        from chunkserve.model.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention(heads, kv_heads, head_dim)
    raise ValueError(f"attention backend must be auto, cpu, torch or triton, got {name!r}.")
