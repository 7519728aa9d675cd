"""Dense CPU linears run on a weight pre-packed for oneDNN; the result is F.linear's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkserve.model.layers import dense_gemm
from chunkserve.model.layers.dense_gemm import DenseWeight
from chunkserve.model.layers.linear import DenseLinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_weight_matches_f_linear(dtype, rows):
    w = torch.randn(96, 80).to(dtype)
    gemm = DenseWeight(w)
    # Packed wherever PyTorch's oneDNN takes the dtype (bf16: not on every CPU).
    assert (gemm.packed is not None) == dense_gemm._can_pack(w) != (gemm.weight is not None)
    if dtype == torch.float32:
        assert gemm.packed is not None  # the CPU wheel has oneDNN
    x = torch.randn(rows, 80)  # float32 in: cast to the weight's dtype, as the model does
    out = gemm(x)
    ref = F.linear(x.to(dtype), w)
    assert out.dtype == dtype and out.shape == (rows, 96)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_strided_input_is_accepted():
    w = torch.randn(32, 16)
    x = torch.randn(5, 32)[:, ::2]  # a view, not contiguous
    torch.testing.assert_close(DenseLinear(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_without_onednn_the_plain_weight_is_used(monkeypatch):
    monkeypatch.setattr(dense_gemm, "_can_pack", lambda weight: False)
    w = torch.randn(32, 16)
    gemm = DenseWeight(w)
    assert gemm.packed is None and gemm.weight is not None
    x = torch.randn(3, 16)
    assert torch.equal(gemm(x), F.linear(x, w))
