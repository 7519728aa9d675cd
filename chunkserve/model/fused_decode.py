"""A decode step's decoder stack as one C call on the CPU (`kernels/csrc/decode_stack.c`): the
CPU's counterpart of a captured CUDA graph, and like one skipped under `--enforce-eager`.

At a few decodes a step the layers' ops are small, and each paid a fixed cost in Python, ctypes,
a tensor allocation and an OpenMP fork-join: measured on a Zen 3 with SmolLM2 (10 ops a layer,
30 layers), about a third of a one-decode step, while the second thread spun idle. The C stack
runs the same kernels (their team entries) in one parallel region, so its hidden states equal
the op-by-op path's bit for bit (tests/test_fused_decode.py).

It takes the models it was written for and says why it does not take another: the Llama
decoder's layer order and SiLU MLP (Qwen2's biases and Qwen3's q/k norms included), every
linear on one group GEMM with a team entry (int4 or int8): the AVX2 one (float32 activations:
CPUs without AVX512_BF16) or the VNNI one (bfloat16 or float32 activations: CPUs with
AVX512_VNNI and BF16), the C layer ops and attention, a float32 or bfloat16 KV cache (bfloat16
for a bfloat16 model), one process. Steps with a prefill chunk, and models it does not take, run
op by op.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from chunkserve.model.attention.cpu_backend import CpuMetadata, CpuPagedAttention
from chunkserve.model.kernels import cpu_library
from chunkserve.model.layers.group_gemm import GroupGemm
from chunkserve.model.layers.layer_ops import MAX_HEAD_DIM, CpuLayerOps
from chunkserve.model.layers.quant_linear import QuantizedLinear
from chunkserve.model.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KV_DTYPES = (torch.float32, torch.bfloat16)


class StackLinear(ctypes.Structure):
    _fields_ = [("levels", _p), ("scales", _p), ("bias", _p), ("n", _i64), ("bits", _i64)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                ("qkv", StackLinear), ("o", StackLinear), ("gate_up", StackLinear),
                ("down", StackLinear), ("k_cache", _p), ("v_cache", _p)]


class StackShape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("rotary_dim", _i64), ("intermediate", _i64), ("kv_kind", _i64),
                ("block_size", _i64), ("gemm", _i64), ("act_bf16", _i64), ("eps", _f32),
                ("scale", _f32)]


# decode_stack.c's GEMM_*: the group GEMMs with a team entry.
STACK_GEMMS = {"avx2": 0, "vnni": 1}


# shape, layers, num_layers, h, mlp_out, cos, sin, T, slots, block table, table width,
# seq_lens, rows, num_seqs, window, num_threads
_ARGTYPES = [ctypes.POINTER(StackShape), ctypes.POINTER(StackLayer), _i64, _p, _p, _p, _p,
             _i64, _p, _p, _i64, _p, _p, _i64, _i64, _i64]


def _group_gemm(linear: object) -> GroupGemm | None:
    """The linear's group GEMM when it has a team entry and runs every row there, unpadded;
    else None."""
    kernel = getattr(linear, "kernel", None)
    if not (isinstance(linear, QuantizedLinear) and isinstance(kernel, GroupGemm)):
        return None
    if kernel.kernel.name not in STACK_GEMMS or linear.dense is not None or \
            kernel.n_out != kernel.n:
        return None
    return kernel


def _linears(model: LlamaForCausalLM) -> list[object]:
    return [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]


def why_not(model: object, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why the C stack cannot run this model's decode steps, or None when it can."""
    llama_forward = type(model).forward is LlamaForCausalLM.forward  # (Gemma 3: its own)
    if not isinstance(model, LlamaForCausalLM) or not llama_forward:
        return "the architecture orders its layer differently"
    if model.hidden_act != "silu" or type(model).extra_layer_norms:
        return "the MLP is not SiLU-gated, or the layer has more norms"
    if model.device.type != "cpu" or model.dtype not in KV_DTYPES:
        return "the activations are neither float32 nor bfloat16 on the CPU"
    if not isinstance(model.ops, CpuLayerOps) or type(model.attn) is not CpuPagedAttention:
        return "the layer ops or attention are not the C kernels"
    if model.head_dim > MAX_HEAD_DIM:
        return f"the head size is over {MAX_HEAD_DIM}"
    if any(k.dtype not in KV_DTYPES for k, _ in kv_caches):
        return "the KV cache is neither float32 nor bfloat16"
    kernels = [_group_gemm(x) for x in _linears(model)]
    if any(k is None for k in kernels) or len({k.kernel.name for k in kernels}) != 1:
        return "a linear is not on a group GEMM with a team entry (or the model is sharded)"
    if model.dtype == torch.bfloat16 and (
            kernels[0].kernel.name != "vnni" or any(k.dtype != model.dtype for k, _ in kv_caches)):
        # The op-by-op path's K/V rows are bfloat16 before they reach the cache.
        return "bfloat16 activations need the vnni group GEMM and a bfloat16 KV cache"
    return None


def _linear(linear: QuantizedLinear, biases: list[torch.Tensor]) -> StackLinear:
    """The C struct of a linear; its bias as float32 (a bfloat16 model's is bfloat16), kept
    alive in `biases`."""
    kernel = _group_gemm(linear)
    assert kernel is not None
    bias = 0
    if linear.bias is not None:
        biases.append(linear.bias.float().contiguous())
        bias = biases[-1].data_ptr()
    return StackLinear(kernel.levels_ptr, kernel.scales_ptr, bias, kernel.n, kernel.bits)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedDecodeStack:
    def __init__(self, model: LlamaForCausalLM,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        cfg, layers = model.cfg, model.layers
        self._rows = kv_caches[0][0].shape[0] * kv_caches[0][0].shape[1]  # cache slots
        gemm = STACK_GEMMS[layers[0].qkv.kernel.kernel.name]  # (one for all: why_not)
        self.shape = StackShape(
            cfg.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
            model.rope.rotary_dim, layers[0].down.shape[1],
            cpu_library.STORAGE_KINDS[kv_caches[0][0].dtype], kv_caches[0][0].shape[1],
            gemm, int(model.dtype == torch.bfloat16), cfg.rms_norm_eps, model.attn.scale)
        self._biases: list[torch.Tensor] = []  # float32 copies the C structs point at
        b = self._biases
        self.layers = (StackLayer * len(layers))(*[
            StackLayer(_ptr(layer.input_norm), _ptr(layer.post_norm),
                       *(_ptr(w) for w in (layer.qk_norm or (None, None))),
                       _linear(layer.qkv, b), _linear(layer.o, b), _linear(layer.gate_up, b),
                       _linear(layer.down, b), _ptr(k), _ptr(v))
            for layer, (k, v) in zip(layers, kv_caches)])
        self._fn = cpu_library.library().decode_stack
        self._fn.argtypes, self._fn.restype = _ARGTYPES, ctypes.c_int

    @classmethod
    def build(cls, model: object, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> FusedDecodeStack | None:
        """The stack for this model, or None (logged: why its decode steps run op by op)."""
        reason = why_not(model, kv_caches)
        if reason is not None:
            logger.info("decode steps run op by op: %s", reason)
            return None
        return cls(model, kv_caches)  # type: ignore[arg-type]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: object) -> torch.Tensor | None:
        """The final-norm hidden states [T, hidden] of a step whose tokens are all decodes
        (as LlamaForCausalLM.forward returns them), or None for any other step."""
        if not isinstance(meta, CpuMetadata) or meta.seqs or not meta.decode_args:
            return None
        table, width, seq_lens, rows, num_seqs, window = meta.decode_args
        T = input_ids.shape[0]
        if num_seqs != T:
            return None
        model = self.model
        CpuPagedAttention.check_slots(meta, self._rows)
        cos, sin = (t.contiguous() for t in model.rope.cos_sin(positions))  # held: C reads them
        h = model.embed_tokens(input_ids).float()
        mlp_out = torch.empty_like(h)
        failed = self._fn(ctypes.byref(self.shape), self.layers, len(self.layers),
                          h.data_ptr(), mlp_out.data_ptr(), cos.data_ptr(), sin.data_ptr(), T,
                          meta.slots_ptr, table, width, seq_lens, rows, num_seqs, window,
                          torch.get_num_threads())
        if failed:
            raise MemoryError("the fused decode step could not allocate its buffers")
        return model.ops.add_rms_norm(h, mlp_out, model.norm, model.cfg.rms_norm_eps, model.dtype)
