"""The CPU attention kernels of the AVX2 build (`CHUNKSERVE_CPU_ISA=avx2`: -march=haswell, no
AVX-512), which runs on any x86-64 host, AVX-512 or not: float32 decodes (paged_decode.c's
generic loop) and chunks (chunk_attention_avx2.c) against the torch reference, on every shape
the AVX512_BF16 kernels are tested on (test_cpu_attention.py) and more head sizes; and greedy
tokens of the tiny Llama identical across the kernels and chunk budgets."""
from __future__ import annotations

import platform

import pytest
import torch
from attention_cases import (CHUNK_HEADS, CHUNKS, DECODE_HEADS, KERNEL_DECODES, MIXED,
                             fits_pool, make_layout, run_step)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chunkserve.model.attention.cpu_backend import CpuPagedAttention
from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.batch import BatchLayout, DeviceStager
from chunkserve.model.kernels import cpu_library


def _avx2_build_here() -> bool:
    if torch.cuda.is_available() or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        cpu_library.library("avx2")
    except cpu_library.KernelBuildError:  # no C compiler
        return False
    return True


pytestmark = pytest.mark.skipif(not _avx2_build_here(),
                                reason="the AVX2 build needs an x86-64 CPU and a C compiler")
# Head sizes the chunk kernel takes beyond the bf16 one's (multiples of 8 up to 256).
OTHER_HEADS = [(6, 3, 48), (4, 2, 32), (8, 2, 16), (4, 1, 256)]


def _avx2_step(layout: BatchLayout, heads: int, kv_heads: int, head_dim: int) -> None:
    """One float32 step through the AVX2 build's kernels, against the torch backend's."""
    backend = CpuPagedAttention(heads, kv_heads, head_dim, isa="avx2")
    assert backend._chunk_kernel is None and backend._chunk_kernel_f32 is not None
    if (layout.query_lens > 1).any():  # the chunks go to the kernel, not SDPA
        meta = backend.build_metadata(DeviceStager(torch.device("cpu")).to_device(layout))
        assert meta.chunk_args
    ref, ref_k, ref_v = run_step(TorchPagedAttention(heads, kv_heads, head_dim), layout, heads,
                                 kv_heads, head_dim)
    out, kc, vc = run_step(backend, layout, heads, kv_heads, head_dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", DECODE_HEADS + OTHER_HEADS)
def test_avx2_decodes_every_block_size_and_group(block_size: int, heads: int, kv_heads: int,
                                                 head_dim: int) -> None:
    _avx2_step(make_layout(KERNEL_DECODES, block_size, contiguous=False), heads, kv_heads,
               head_dim)


@pytest.mark.parametrize("block_size", [8, 16, 32, 48])
@pytest.mark.parametrize("heads,kv_heads,head_dim", CHUNK_HEADS + OTHER_HEADS)
def test_avx2_chunks_every_block_size_and_group(block_size: int, heads: int, kv_heads: int,
                                               head_dim: int) -> None:
    _avx2_step(make_layout(CHUNKS, block_size, contiguous=False), heads, kv_heads, head_dim)


@pytest.mark.parametrize("contiguous", [False, True])
def test_avx2_mixed_step(contiguous: bool) -> None:
    _avx2_step(make_layout(MIXED, 16, contiguous=contiguous), 9, 3, 64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 120), st.sampled_from([1, 1, 2, 5, 8, 9, 33, 70])),
                  min_size=1, max_size=5),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 2, 3, 4, 5, 8]),
    head_dim=st.sampled_from([16, 64, 128]),
    seed=st.integers(0, 100),
)
def test_avx2_random_batches(spec: list[tuple[int, int]], block_size: int, group: int,
                             head_dim: int, seed: int) -> None:
    assume(fits_pool(spec, block_size))
    _avx2_step(make_layout(spec, block_size, contiguous=False, seed=seed), 2 * group, 2,
               head_dim)


def test_avx2_chunk_of_a_long_prompt() -> None:
    """A 600-token chunk after 700 cached: tasks far more than threads, keys over many steps
    (the online softmax rescales its running output dozens of times)."""
    from attention_cases import NUM_BLOCKS as n

    block_size = -(-1300 // (n - 4))  # the whole context within the shared pool of blocks
    _avx2_step(make_layout([(700, 600), (0, 1)], block_size, contiguous=False), 9, 3, 64)


def test_greedy_tokens_identical_across_kernels_and_budgets(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine as on an AVX2-only CPU (float32): the AVX2 chunk kernel and SDPA, whole
    prompts and chunks of 16 (which split prompts and mix them with decodes), same tokens."""
    from chunkserve import LLM, SamplingParams

    monkeypatch.setenv("CHUNKSERVE_CPU_ISA", "avx2")
    prompts = [list(range(5, 5 + n)) for n in (5, 37, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "torch"):
        for budget in (16, 512):
            llm = LLM(model=tiny_model_dir, attention_backend=backend, dtype="float32",
                      max_num_batched_tokens=budget, max_model_len=256)
            attn = llm.engine.executor.model.attn  # type: ignore[attr-defined]
            assert backend == "torch" or attn._chunk_kernel_f32 is not None
            outs = llm.generate(prompts, params)
            tokens[backend, budget] = [o.outputs[0].token_ids for o in outs]
            llm.engine.close()
    first = tokens["cpu", 16]
    assert all(len(t) == 8 for t in first)
    assert all(t == first for t in tokens.values()), tokens
