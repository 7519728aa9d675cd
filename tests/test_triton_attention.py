"""The Triton paged-attention kernels against the torch reference backend (fp32, 1e-5).

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest), so the
shapes stay small. Each case is a whole step: the backend writes the new K/V into the cache by
slot mapping, then attends; both outputs and both caches must agree.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from attention_cases import (  # noqa: E402
    DECODES, DEVICE, FIRST_CHUNKS, LATER_CHUNKS, MIXED, NUM_BLOCKS, make_layout, run_step,
)

from chunkserve.model.attention.torch_backend import TorchPagedAttention  # noqa: E402
from chunkserve.model.attention.triton_backend import TritonPagedAttention  # noqa: E402
from chunkserve.model.batch import DeviceStager  # noqa: E402

def run_both(layout, heads: int, kv_heads: int, head_dim: int):  # type: ignore[no-untyped-def]
    """[(out, k_cache, v_cache)] of the torch reference, then of Triton, on the same data."""
    return [run_step(backend(heads, kv_heads, head_dim), layout, heads, kv_heads, head_dim)
            for backend in (TorchPagedAttention, TritonPagedAttention)]


CASES = [
    # (spec, block_size, heads, kv_heads, head_dim, contiguous)
    (DECODES, 16, 8, 2, 32, False),  # GQA group 4
    (DECODES, 32, 6, 2, 16, True),  # group 3: rows of a program span tokens
    (FIRST_CHUNKS, 16, 4, 4, 16, False),  # MHA
    (FIRST_CHUNKS, 32, 8, 2, 32, False),
    (LATER_CHUNKS, 16, 6, 2, 16, False),
    (LATER_CHUNKS, 32, 4, 1, 32, True),  # group 4, one KV head
    (MIXED, 16, 6, 2, 32, False),
    (MIXED, 32, 8, 2, 16, False),
    (MIXED, 16, 9, 3, 64, True),  # SmolLM2's heads
    ([(10, 130), (7, 1)], 16, 8, 2, 16, False),  # a long chunk: 128-row tiles
]


@pytest.mark.parametrize("spec,block_size,heads,kv_heads,head_dim,contiguous", CASES)
def test_triton_matches_torch(spec, block_size, heads, kv_heads, head_dim, contiguous):
    layout = make_layout(spec, block_size, contiguous)
    (ref, ref_k, ref_v), (out, kc, vc) = run_both(layout, heads, kv_heads, head_dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 24)), min_size=1, max_size=5),
    block_size=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 2, 3, 4]),
    seed=st.integers(0, 100),
)
def test_triton_matches_torch_random_batches(spec, block_size, group, seed):
    layout = make_layout(spec, block_size, contiguous=False, seed=seed)
    (ref, ref_k, ref_v), (out, kc, vc) = run_both(layout, 2 * group, 2, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_padding_rows_write_nothing_and_leave_real_rows_alone():
    """A CUDA graph's padded batch (requests with no context and slot -1) gives the real rows
    exactly what the unpadded batch gives, writes nothing for the padding, and stays finite."""
    layout = make_layout(DECODES, 16, contiguous=False)
    padded = layout.padded(8, layout.block_table.shape[1] + 3)
    n = layout.num_tokens
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(8, h, 32, generator=gen).to(DEVICE) for h in (8, 2, 2))
    cache = torch.randn(NUM_BLOCKS, 16, 2, 32, generator=gen).to(DEVICE)
    backend = TritonPagedAttention(8, 2, 32)
    stager = DeviceStager(DEVICE)
    results = []
    for lay, rows in ((layout, n), (padded, 8)):
        kc, vc = cache.clone(), cache.clone()
        meta = backend.build_metadata(stager.to_device(lay))
        results.append((backend.forward(q[:rows], k[:rows], v[:rows], kc, vc, meta), kc, vc))
    (out, kc, vc), (out_p, kc_p, vc_p) = results
    assert torch.equal(out_p[:n], out)
    assert torch.equal(kc_p, kc) and torch.equal(vc_p, vc)
    assert torch.isfinite(out_p).all() and not out_p[n:].any()
