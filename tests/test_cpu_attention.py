"""The CPU backend (decodes batched into one numba kernel call) against the torch reference."""
from __future__ import annotations

import pytest
import torch
from attention_cases import DECODES, FIRST_CHUNKS, LATER_CHUNKS, MIXED, make_layout, run_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.model.attention_cpu import CpuPagedAttention
from chunkserve.model.attention_torch import TorchPagedAttention

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's tests")


def _compare(layout, heads: int, kv_heads: int, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    ref, ref_k, ref_v = run_step(TorchPagedAttention(heads, kv_heads, head_dim), layout, heads,
                                 kv_heads, head_dim)
    out, kc, vc = run_step(CpuPagedAttention(heads, kv_heads, head_dim), layout, heads,
                           kv_heads, head_dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("spec,block_size,heads,kv_heads,head_dim,contiguous", [
    (DECODES, 16, 8, 2, 32, False),
    (DECODES, 32, 9, 3, 64, True),  # SmolLM2's heads
    (DECODES, 16, 4, 4, 16, False),  # MHA
    (FIRST_CHUNKS, 16, 6, 2, 16, False),  # a one-token prompt is a "decode" to the kernel
    (LATER_CHUNKS, 32, 4, 1, 32, True),
    (MIXED, 16, 6, 2, 32, False),
    (MIXED, 16, 9, 3, 64, True),
])
def test_cpu_backend_matches_torch(spec, block_size, heads, kv_heads, head_dim, contiguous):
    _compare(make_layout(spec, block_size, contiguous), heads, kv_heads, head_dim)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 5, 17])),
                  min_size=1, max_size=6),
    block_size=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 2, 3, 4]),
    seed=st.integers(0, 100),
)
def test_cpu_backend_matches_torch_random_batches(spec, block_size, group, seed):
    _compare(make_layout(spec, block_size, contiguous=False, seed=seed), 2 * group, 2, 16)
