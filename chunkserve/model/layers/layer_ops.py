"""A decoder layer's small ops (RMSNorm with the residual add, RoPE, SiLU-and-mul) behind one
interface: PyTorch ops (any device; the reference), or one C call each on the CPU
(`kernels/csrc/layer_ops.c`), which at a few tokens a step is mostly PyTorch's fixed cost per
op saved (docs/performance.md).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Protocol

import torch

from chunkserve.model.kernels import cpu_library
from chunkserve.model.layers.rotary import apply_rotary

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RMSNorm computed in float32 (as HF does; `x` and `weight` are float32), returned in
    `dtype`. PyTorch's fused kernel: one op where the spelled-out formula is five, and a decode
    step runs 61 of them."""
    out = torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if dtype == torch.float32 else out.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`). PyTorch's ops on
    every device: no C kernel yet, so the Llama family's SiLU path is untouched."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# Qwen3's per-head RMSNorm weights of q and k (float32, [head_dim] each), or None.
QKNorm = tuple[torch.Tensor, torch.Tensor] | None


class LayerOps(Protocol):
    name: str

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, dtype: torch.dtype) -> torch.Tensor:
        """h += delta (in place; h is the float32 residual stream), then RMSNorm(h) * weight
        computed in float32 and returned in `dtype`."""
        ...

    def rope_split_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       heads: int, kv_heads: int, head_dim: int, qk_norm: QKNorm = None,
                       eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] in qkv's dtype from a fused projection,
        the first R dims of each q and k head rotated (cos/sin: [T, 1, R / 2] float32; R < D
        for partial rotary), each q and k head RMSNorm'd first by `qk_norm`'s (q, k) weights
        [D] (float32) when given (Qwen3)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        ...


class TorchLayerOps:
    name = "torch"

    def add_rms_norm(self, h, delta, weight, eps, dtype):  # type: ignore[no-untyped-def]
        if delta is not None:
            h += delta  # widening to float32 in the add: no temporary
        return rms_norm(h, weight, eps, dtype)

    def rope_split_qkv(self, qkv, cos, sin, heads, kv_heads, head_dim, qk_norm=None, eps=0.0):  # type: ignore[no-untyped-def]
        T, qk_size = qkv.shape[0], (heads + kv_heads) * head_dim
        # Q and K heads rotated in one pass (RoPE is per head): half the small ops.
        qk = qkv[:, :qk_size].view(T, heads + kv_heads, head_dim)
        if qk_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :heads].float(), qk_norm[0], eps),
                            rms_norm(qk[:, heads:].float(), qk_norm[1], eps)], dim=1)
        rotary_dim = 2 * cos.shape[-1]
        if rotary_dim == head_dim:
            qk = apply_rotary(qk, cos, sin)
        else:  # partial rotary: the rest of each head passes through
            qk = torch.cat([apply_rotary(qk[..., :rotary_dim], cos, sin),
                            qk[..., rotary_dim:].float()], dim=-1)
        q, k = qk.to(qkv.dtype).split([heads, kv_heads], dim=1)
        return q, k, qkv[:, qk_size:].view(T, kv_heads, head_dim)

    def silu_and_mul(self, gate_up):  # type: ignore[no-untyped-def]
        return silu_and_mul(gate_up)


_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    # h, delta, delta_bf16, weight, out, out_bf16, T, H, eps, num_threads
    "add_rms_norm": [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _i64],
    # gate_up, out, bf16, T, I, num_threads
    "silu_and_mul": [_ptr, _ptr, _i64, _i64, _i64, _i64],
    # qkv, cos, sin, q, k, v, bf16, T, heads, kv_heads, D, R, q_norm, k_norm, eps, num_threads
    "rope_split_qkv": [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                       _ptr, _ptr, _f32, _i64],
}
_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 512  # layer_ops.c normalizes and rotates a head in a stack buffer this long


def _norm_ptrs(qk_norm: QKNorm) -> tuple[int | None, int | None]:
    if qk_norm is None:
        return None, None
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in qk_norm)
    return qk_norm[0].data_ptr(), qk_norm[1].data_ptr()


class CpuLayerOps:
    """The C kernels. Every tensor is contiguous, float32 or bfloat16, on the CPU."""

    name = "cpu"

    def __init__(self) -> None:
        lib = cpu_library.library()
        self._fn = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
            self._fn[name] = fn

    def add_rms_norm(self, h, delta, weight, eps, dtype):  # type: ignore[no-untyped-def]
        assert h.dtype == torch.float32 and h.is_contiguous() and dtype in _DTYPES
        out = torch.empty(h.shape, dtype=dtype)
        if delta is not None:
            delta = delta.contiguous()
            assert delta.dtype in _DTYPES and delta.shape == h.shape
        self._fn["add_rms_norm"](
            h.data_ptr(), None if delta is None else delta.data_ptr(),
            delta is not None and delta.dtype == torch.bfloat16, weight.data_ptr(),
            out.data_ptr(), dtype == torch.bfloat16, h.shape[0], h.shape[1], eps,
            torch.get_num_threads())
        return out

    def rope_split_qkv(self, qkv, cos, sin, heads, kv_heads, head_dim, qk_norm=None, eps=0.0):  # type: ignore[no-untyped-def]
        assert qkv.dtype in _DTYPES and qkv.is_contiguous() and head_dim <= MAX_HEAD_DIM
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        T = qkv.shape[0]
        q = torch.empty(T, heads, head_dim, dtype=qkv.dtype)
        k = torch.empty(T, kv_heads, head_dim, dtype=qkv.dtype)
        v = torch.empty(T, kv_heads, head_dim, dtype=qkv.dtype)
        self._fn["rope_split_qkv"](
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
            v.data_ptr(), qkv.dtype == torch.bfloat16, T, heads, kv_heads, head_dim,
            2 * cos.shape[-1], *_norm_ptrs(qk_norm), eps, torch.get_num_threads())
        return q, k, v

    def silu_and_mul(self, gate_up):  # type: ignore[no-untyped-def]
        assert gate_up.dtype in _DTYPES and gate_up.is_contiguous()
        T, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(T, inter, dtype=gate_up.dtype)
        self._fn["silu_and_mul"](gate_up.data_ptr(), out.data_ptr(),
                                 gate_up.dtype == torch.bfloat16, T, inter,
                                 torch.get_num_threads())
        return out


def make_layer_ops(device: torch.device) -> LayerOps:
    """The C kernels on the CPU when they build here, else PyTorch's ops."""
    if device.type != "cpu":
        return TorchLayerOps()
    try:
        return CpuLayerOps()
    except cpu_library.KernelBuildError as e:
        logger.warning("%s Falling back to PyTorch's ops for norms, RoPE and SiLU.", e)
        return TorchLayerOps()
