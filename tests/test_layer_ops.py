"""The C layer ops (norm with residual add, RoPE split, SiLU-and-mul) against PyTorch's."""
from __future__ import annotations

import pytest
import torch

from chunkserve.model.kernels import cpu_library
from chunkserve.model.layers import layer_ops
from chunkserve.model.layers.layer_ops import CpuLayerOps, TorchLayerOps, make_layer_ops
from chunkserve.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU kernels' tests")

ROWS = [0, 1, 5, 130]  # 130 x 576 is past the kernels' threshold for using every thread


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # float32 arithmetic, one rounding to bfloat16 (PyTorch may round twice)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rows, dtype, with_delta):
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen) * 3
    delta = torch.randn(rows, 576, generator=gen).to(dtype) if with_delta else None
    w = torch.rand(576, generator=gen) + 0.5
    h_ref = h.clone()
    ref = TorchLayerOps().add_rms_norm(h_ref, delta, w, 1e-5, dtype)
    out = CpuLayerOps().add_rms_norm(h, delta, w, 1e-5, dtype)
    _close(out, ref)
    torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)  # the residual, updated in place


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
def test_rope_split_qkv(rows, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(rows + heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (rows,), generator=gen))
    ref = TorchLayerOps().rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    out = CpuLayerOps().rope_split_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    for o, r in zip(out, ref):
        _close(o, r.contiguous())
    assert torch.equal(out[2], ref[2])  # V is copied, not rotated


@pytest.mark.parametrize("rows", [1, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (96, 72), (64, 32)])
def test_rope_split_qkv_with_qk_norm_and_partial_rotary(rows, dtype, qk_norm, head_dim,
                                                        rotary_dim):
    """Qwen3's per-head q/k RMSNorm before RoPE, and partial rotary (Phi-4-mini: 3/4 of each
    head rotated, the rest passed through)."""
    heads, kv_heads = 8, 2
    gen = torch.Generator().manual_seed(rows + head_dim)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    norms = (torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) + 0.5)
    rope = RotaryEmbedding(head_dim, 4096, 1e6, None, rotary_dim=rotary_dim)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (rows,), generator=gen))
    args = (qkv, cos, sin, heads, kv_heads, head_dim, norms if qk_norm else None, 1e-6)
    ref = TorchLayerOps().rope_split_qkv(*args)
    out = CpuLayerOps().rope_split_qkv(*args)
    for o, r in zip(out, ref):
        _close(o, r.contiguous())
    if not qk_norm:  # the dimensions past rotary_dim are q's and k's own values
        q = qkv.view(rows, -1, head_dim)[:, :heads]
        assert torch.equal(out[0][..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(rows, dtype):
    gate_up = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    _close(CpuLayerOps().silu_and_mul(gate_up), TorchLayerOps().silu_and_mul(gate_up))


def test_without_a_compiler_the_model_uses_pytorchs_ops(monkeypatch, caplog):
    def no_build() -> None:
        raise cpu_library.KernelBuildError("no C compiler here")

    monkeypatch.setattr(layer_ops.cpu_library, "library", no_build)
    assert isinstance(make_layer_ops(torch.device("cpu")), TorchLayerOps)
    assert "no C compiler here" in caplog.text
    assert make_layer_ops(torch.device("cpu")).name == "torch"
