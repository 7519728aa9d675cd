"""Sliding-window attention in every backend (torch, cpu, triton) against a dense reference.

The reference is plain float32 softmax attention with a band mask: a query at position q sees
key k iff q - W < k <= q. Each step is run the way the engine runs a sliding-window KV-cache
group: the block-table entries before the window of a request's first query
(`first_window_block`) are holes, which the KV cache has freed. Here they point at a block
full of NaN: a backend that reads one, even to mask it (0 * NaN = NaN), gives a non-finite
output. Decodes sit before, at and past the window; chunks start at 0, straddle its edge and
start far past it; steps mix both; W is a multiple of the block size and not.
"""
from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from attention_cases import DEVICE, NUM_BLOCKS, make_layout

from chunkserve.model.attention.backend import AttentionBackend, first_window_block
from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.batch import BatchLayout, DeviceStager

if TYPE_CHECKING:  # imported in the tests that run them: either may be unavailable here
    from chunkserve.model.attention.cpu_backend import CpuPagedAttention
    from chunkserve.model.attention.triton_backend import TritonPagedAttention

BLOCK_SIZE = 16
WINDOWS = [16, 32, 20]  # one block, two blocks, not a multiple of the block size
HEADS = [(4, 1, 256), (8, 2, 64)]  # Gemma 3 270M's heads (group 4, head_dim 256); GQA 64


def decodes(w: int) -> list[tuple[int, int]]:
    """(cached tokens, new tokens): a decode's query sits at position `cached`."""
    return [(w - 2, 1), (w - 1, 1), (w, 1), (w + 1, 1), (3 * w + 5, 1), (0, 1)]


def chunks(w: int) -> list[tuple[int, int]]:
    # From 0 and longer than the window; across its edge; far past it; a long one across it.
    return [(0, w + 10), (w - 5, 12), (4 * w + 3, 9), (2 * w - 1, 2 * w + 3)]


def mixed(w: int) -> list[tuple[int, int]]:
    return [(0, 13), (3 * w + 1, 1), (w - 3, 10), (5, 1), (5 * w + 2, 17), (2 * w, 1)]


SPECS = {"decodes": decodes, "chunks": chunks, "mixed": mixed}


# ---- the backends ---------------------------------------------------------------------------
def _torch(heads: int, kv_heads: int, head_dim: int) -> TorchPagedAttention:
    backend = TorchPagedAttention(heads, kv_heads, head_dim)
    backend.band_rows = 8  # bands of W rows: a chunk longer than W spans several
    return backend


def _cpu_kernels_here() -> bool:
    if DEVICE.type != "cpu":
        return False
    from chunkserve.model.kernels import cpu_library

    try:
        cpu_library.load()
    except cpu_library.KernelBuildError:
        return False
    return True


def _cpu(heads: int, kv_heads: int, head_dim: int) -> CpuPagedAttention:
    from chunkserve.model.attention.cpu_backend import CpuPagedAttention

    return CpuPagedAttention(heads, kv_heads, head_dim)


def _triton_here() -> bool:
    try:
        from chunkserve.model.attention.select import check_triton

        check_triton(DEVICE)
    except ValueError:
        return False
    return True


def _triton(heads: int, kv_heads: int, head_dim: int) -> TritonPagedAttention:
    from chunkserve.model.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention(heads, kv_heads, head_dim)


BACKENDS = [
    pytest.param(_torch, id="torch"),
    pytest.param(_cpu, id="cpu", marks=pytest.mark.skipif(
        not _cpu_kernels_here(), reason="the CPU kernels do not build or run here")),
    pytest.param(_triton, id="triton", marks=pytest.mark.skipif(
        not _triton_here(), reason="Triton cannot run here (no GPU, no interpreter)")),
]


# ---- a step with holes, and the reference ---------------------------------------------------
def with_holes(layout: BatchLayout, window: int | None) -> tuple[BatchLayout, int]:
    """The layout with each request's freed entries (before its first window block) pointing
    at one block no request uses, and that block's id."""
    used = {int(b) for i, n in enumerate(-(-layout.seq_lens // layout.block_size))
            for b in layout.block_table[i, :n]}
    nan_block = max(set(range(NUM_BLOCKS)) - used)
    table = layout.block_table.copy()
    starts = layout.seq_lens - layout.query_lens
    for i, start in enumerate(starts.tolist()):
        table[i, : first_window_block(start, window, layout.block_size)] = nan_block
    return replace(layout, block_table=table), nan_block


def band_reference(layout: BatchLayout, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """float32 softmax(q k^T * scale) v per request, over its keys q - W < k <= q."""
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], kc.shape[2]
    flat_k, flat_v = (c.reshape(-1, kv_heads, head_dim).float() for c in (kc, vc))
    out = torch.empty(q.shape[0], heads * head_dim)
    bs = layout.block_size
    for i, ctx in enumerate(layout.seq_lens.tolist()):
        a, b = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        pos = torch.arange(ctx)
        slots = torch.from_numpy(layout.block_table[i])[pos // bs] * bs + pos % bs
        k = flat_k[slots].repeat_interleave(heads // kv_heads, dim=1)
        v = flat_v[slots].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * head_dim**-0.5
        q_pos = torch.arange(ctx - (b - a), ctx).unsqueeze(1)
        seen = pos.unsqueeze(0) <= q_pos
        if window is not None:
            seen &= q_pos - pos.unsqueeze(0) < window
        scores.masked_fill_(~seen, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b - a, -1)
    return out


def run_windowed(backend: AttentionBackend, layout: BatchLayout, window: int | None,
                 dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, reference) of one step whose freed blocks read as NaN."""
    holed, nan_block = with_holes(layout, window)
    heads, kv_heads, head_dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.block_size, kv_heads, head_dim)
    q, k, v, kc, vc = (torch.randn(s, generator=gen).to(dtype) for s in (
        (layout.num_tokens, heads, head_dim), (layout.num_tokens, kv_heads, head_dim),
        (layout.num_tokens, kv_heads, head_dim), shape, shape))
    kc[nan_block] = float("nan")
    vc[nan_block] = float("nan")
    # The reference's caches, written here (not by the backend) and read through the whole table.
    ref_k, ref_v = kc.float(), vc.float()
    slots = torch.from_numpy(layout.slot_mapping)
    ref_k.view(-1, kv_heads, head_dim)[slots] = k.float()
    ref_v.view(-1, kv_heads, head_dim)[slots] = v.float()
    q, k, v, kc, vc = (t.to(DEVICE) for t in (q, k, v, kc, vc))
    batch = DeviceStager(DEVICE).to_device(holed)
    with torch.inference_mode():
        out = backend.forward(q, k, v, kc, vc, backend.build_metadata(batch, window))
    return out.float().cpu(), band_reference(layout, q.cpu(), ref_k, ref_v, window)


# ---- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("make", BACKENDS)
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_window_matches_band_reference(make: Callable, spec: str, window: int, heads: int,
                                       kv_heads: int, head_dim: int) -> None:
    layout = make_layout(SPECS[spec](window), BLOCK_SIZE, contiguous=False, seed=window)
    out, ref = run_windowed(make(heads, kv_heads, head_dim), layout, window, torch.float32)
    assert torch.isfinite(out).all(), "a freed block was read"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not _cpu_kernels_here(), reason="the CPU kernels do not build or run here")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_cpu_bfloat16_kernels_window(window: int, heads: int, kv_heads: int,
                                     head_dim: int) -> None:
    """bfloat16: the AVX512_BF16 decode path and chunk kernel (head sizes 64 and 256) where
    the CPU has them, else the generic decode loop and SDPA for chunks."""
    backend = _cpu(heads, kv_heads, head_dim)
    layout = make_layout(mixed(window) + chunks(window)[-1:], BLOCK_SIZE, contiguous=True)
    out, ref = run_windowed(backend, layout, window, torch.bfloat16)
    assert torch.isfinite(out).all(), "a freed block was read"
    # The kernels round the output (and the chunk kernel P) to bfloat16; SDPA rounds inside too.
    atol = 1e-2 if backend._chunk_kernel is not None else 3e-2
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("make", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_no_window_is_full_attention_unchanged(make: Callable, heads: int, kv_heads: int,
                                               head_dim: int) -> None:
    """window=None is the old call (no argument) exactly, and a window longer than every
    context changes nothing either; both equal causal attention over the whole context."""
    layout = make_layout(mixed(20) + chunks(20), BLOCK_SIZE, contiguous=False)
    backend = make(heads, kv_heads, head_dim)
    stager = DeviceStager(DEVICE)
    gen = torch.Generator().manual_seed(3)
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    data = [torch.randn(s, generator=gen).to(DEVICE) for s in (
        (layout.num_tokens, heads, head_dim), (layout.num_tokens, kv_heads, head_dim),
        (layout.num_tokens, kv_heads, head_dim), shape, shape)]
    builds: list[Callable] = [lambda b: backend.build_metadata(b),
                              lambda b: backend.build_metadata(b, None),
                              lambda b: backend.build_metadata(b, 10_000)]
    outs = []
    with torch.inference_mode():
        for build in builds:
            q, k, v, kc, vc = (t.clone() for t in data)
            outs.append(backend.forward(q, k, v, kc, vc, build(stager.to_device(layout))).cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = band_reference(layout, q.cpu(), kc.cpu(), vc.cpu(), None)
    torch.testing.assert_close(outs[0], ref, atol=1e-4, rtol=1e-4)


def test_torch_decode_reads_from_the_window_block_and_slices() -> None:
    """The torch backend's plan: a decode at position 100 with W = 20 and blocks of 16 reads
    from block 5 (position 80; its query sees 81..100) and a chunk across the edge in bands."""
    layout = make_layout([(100, 1), (30, 40)], BLOCK_SIZE, contiguous=True)
    meta = TorchPagedAttention(4, 1, 64).build_metadata(DeviceStager(DEVICE).to_device(layout),
                                                        20)
    decode, chunk = meta.seqs
    assert decode.key_start == 80 and decode.runs == [(5, 2)] and decode.bands is None
    assert chunk.key_start == 0 and chunk.bands is not None  # 30 - 20 + 1 = 11: block 0
    band = chunk.bands[0]
    assert (band.q_lo, band.q_hi, band.k_lo, band.k_hi) == (0, 40, 11, 70)


# ---- the AVX2 build ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def avx2_library() -> ctypes.CDLL:
    """The kernels built for an AVX2-only CPU (CHUNKSERVE_CPU_ISA=avx2): no AVX-512 paths."""
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_kernels_here():
        pytest.skip("an x86-64 CPU with a C compiler")
    from chunkserve.model.kernels import cpu_library

    return cpu_library.library("avx2")


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_avx2_build_window(avx2_library: ctypes.CDLL, spec: str, window: int, heads: int,
                           kv_heads: int, head_dim: int) -> None:
    """The CPU backend on the AVX2 build, float32: decodes in its generic loop, chunks in the
    AVX2 chunk kernel (chunk_attention_avx2.c), which must not read a freed block either."""
    from chunkserve.model.attention.cpu_backend import CpuPagedAttention

    backend = CpuPagedAttention(heads, kv_heads, head_dim, isa="avx2")
    assert backend._chunk_kernel is None and backend._chunk_kernel_f32 is not None
    layout = make_layout(SPECS[spec](window), BLOCK_SIZE, contiguous=False, seed=window)
    out, ref = run_windowed(backend, layout, window, torch.float32)
    assert torch.isfinite(out).all(), "a freed block was read"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_avx2_build_window_bfloat16(avx2_library: ctypes.CDLL, heads: int, kv_heads: int,
                                    head_dim: int) -> None:
    """bfloat16 on the AVX2 build (no AVX512_BF16): the generic decode loop, SDPA for chunks."""
    from chunkserve.model.attention.cpu_backend import CpuPagedAttention

    backend = CpuPagedAttention(heads, kv_heads, head_dim, isa="avx2")
    layout = make_layout(mixed(20), BLOCK_SIZE, contiguous=False)
    out, ref = run_windowed(backend, layout, 20, torch.bfloat16)
    assert torch.isfinite(out).all(), "a freed block was read"
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_first_window_block_matches_the_freed_blocks() -> None:
    """What a backend skips is what kv_cache.py frees: blocks wholly before the window of the
    step's first query (position `start`), i.e. before max(0, start - W + 1) // block_size."""
    for start in range(0, 80):
        for w in WINDOWS:
            expect = max(0, start - w + 1) // BLOCK_SIZE
            assert first_window_block(start, w, BLOCK_SIZE) == expect
    assert first_window_block(500, None, BLOCK_SIZE) == 0
    assert np.all(np.asarray([first_window_block(s, 10**6, 16) for s in range(100)]) == 0)
