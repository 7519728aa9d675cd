"""The torch backend (the reference the others are tested against) against plain attention
written out: softmax(q k^T * scale, causal to the bottom right) v, request by request."""
from __future__ import annotations

import pytest
import torch
from attention_cases import DECODES, FIRST_CHUNKS, LATER_CHUNKS, MIXED, make_layout, run_step

from chunkserve.model.attention.backend import causal_mask
from chunkserve.model.attention.torch_backend import TorchPagedAttention

LONG_AFTER_PREFIX = [(600, 300), (37, 500), (1, 2)]  # chunks after prefixes of every size


def naive(layout, q, kc, vc, heads: int, kv_heads: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    flat_k = kc.reshape(-1, kv_heads, kc.shape[-1]).float()
    flat_v = vc.reshape(-1, kv_heads, vc.shape[-1]).float()
    out = torch.empty(q.shape[0], heads * q.shape[-1])
    for i, ctx in enumerate(layout.seq_lens.tolist()):
        a, b = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        pos = torch.arange(ctx)
        slots = torch.from_numpy(layout.block_table[i])[pos // layout.block_size] \
            * layout.block_size + pos % layout.block_size
        k = flat_k[slots].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, heads, d]
        v = flat_v[slots].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * q.shape[-1] ** -0.5
        scores.masked_fill_(~causal_mask(ctx - (b - a), b - a), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b - a, -1)
    return out


@pytest.mark.parametrize("spec", [DECODES, FIRST_CHUNKS, LATER_CHUNKS, MIXED, LONG_AFTER_PREFIX])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32)])
def test_torch_backend_is_plain_attention(spec, heads, kv_heads, head_dim):
    layout = make_layout(spec, 16, contiguous=False)
    out, kc, vc = run_step(TorchPagedAttention(heads, kv_heads, head_dim), layout, heads,
                           kv_heads, head_dim)
    gen = torch.Generator().manual_seed(1)  # run_step's q: its first draw
    q = torch.randn((layout.num_tokens, heads, head_dim), generator=gen)
    torch.testing.assert_close(out, naive(layout, q, kc, vc, heads, kv_heads), rtol=1e-4,
                               atol=1e-4)
