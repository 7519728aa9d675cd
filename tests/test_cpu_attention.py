"""The CPU backend (decodes batched into one C kernel call) against the torch reference."""
from __future__ import annotations

import os

import pytest
import torch
from attention_cases import (CHUNK_HEADS, CHUNKS, DECODE_HEADS, DECODES, FIRST_CHUNKS,
                             KERNEL_DECODES, LATER_CHUNKS, MIXED, NUM_BLOCKS, fits_pool,
                             make_layout, run_step)

LONG_DECODES = [(299, 1), (700, 1), (255, 1), (256, 1), (511, 1), (0, 1), (40, 30)]
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chunkserve.model.kernels import cpu_library
from chunkserve.model.attention.cpu_backend import CpuPagedAttention
from chunkserve.model.attention.torch_backend import TorchPagedAttention

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's tests")
def _chunk_kernel_here() -> bool:
    try:
        return cpu_library.load_chunk_bf16(64) is not None
    except cpu_library.KernelBuildError:  # no compiler: the build tests below say so
        return False


CHUNK_KERNEL_HERE = _chunk_kernel_here()
needs_chunk_kernel = pytest.mark.skipif(not CHUNK_KERNEL_HERE,
                                        reason="the bf16 chunk kernel needs AVX512_BF16")


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
    # Contexts across the kernel's 256-token parts: at, just under and over part boundaries.
    (LONG_DECODES, 32, 9, 3, 64, False),
    (LONG_DECODES, 32, 8, 2, 128, True),  # head_dim 128: the other specialised size
    (LONG_DECODES, 32, 6, 3, 48, False),  # any other head size
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


def test_kernel_runs_on_pytorchs_openmp_runtime():
    """One libgomp.so.1 in the process: the kernel's threads are PyTorch's, not a second pool
    that would spin against it. (Wheels that vendor a renamed copy, such as sentencepiece's
    libgomp-<hash>.so, which the test suite imports, cannot satisfy the kernel's libgomp.so.1.)"""
    cpu_library.load()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libgomp" in line}
    gomp = {p for p in paths if p.rsplit("/", 1)[-1].startswith("libgomp.so")}
    assert len(gomp) == 1, paths


def test_loading_the_kernels_leaves_the_float_state_alone():
    """Built with -ffast-math, but linked without it: GCC would otherwise add crtfastmath.o,
    which sets flush-to-zero for the whole process on load (a float32 subnormal would read 0)."""
    cpu_library.library()
    assert (torch.tensor([1e-39]) * 2).item() != 0.0
    assert 5e-324 * 2 != 0.0


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(cpu_library.shutil, "which", lambda name: None)
    with pytest.raises(cpu_library.KernelBuildError, match="no C compiler"):
        cpu_library._compiler()


def test_build_is_cached_by_source_and_cpu(monkeypatch, tmp_path):
    # The build and its cache on a one-function source, with the real compiler and flags: the
    # kernels themselves take seconds a compile, and every session compiles them anyway, into
    # its own fresh cache folder (conftest), before the tests that run them.
    source = tmp_path / "csrc"
    source.mkdir()
    (source / "k.c").write_text('#include "k.h"\nint k(void) { return K; }\n')
    (source / "k.h").write_text("#define K 1\n")
    monkeypatch.setattr(cpu_library, "SOURCE_DIR", str(source))
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cc = cpu_library._compiler()
    first = cpu_library._build(cc, "native")
    mtime = os.path.getmtime(first)
    assert cpu_library._build(cc, "native") == first and os.path.getmtime(first) == mtime  # not rebuilt
    assert os.listdir(os.path.dirname(first)) == [os.path.basename(first)]  # no temp files left
    (source / "k.h").write_text("#define K 2\n")  # a header the .c includes: built anew
    second = cpu_library._build(cc, "native")
    assert second != first and os.path.isfile(second)
    monkeypatch.setattr(cpu_library, "_cpu_id", lambda: "another CPU")  # -march=native's
    assert cpu_library._build(cc, "native") not in (first, second)


def _bf16_step(layout, heads: int, kv_heads: int, head_dim: int):  # type: ignore[no-untyped-def]
    """The CPU backend on a bfloat16 cache and the torch one in float32 over the same values:
    (out, ref, decode rows, the caches of each)."""
    ref, ref_k, ref_v = run_step(TorchPagedAttention(heads, kv_heads, head_dim), layout, heads,
                                 kv_heads, head_dim, values_in=torch.bfloat16)
    out, kc, vc = run_step(CpuPagedAttention(heads, kv_heads, head_dim), layout, heads, kv_heads,
                           head_dim, dtype=torch.bfloat16)
    decode = torch.from_numpy(layout.query_lens == 1).repeat_interleave(
        torch.from_numpy(layout.query_lens))
    assert out.dtype == torch.bfloat16
    # The kernels' rows: decodes are one rounding of a float32 result (bf16 keeps 8 bits:
    # relative 2^-8); chunks, where the bf16 chunk kernel exists (an AVX512_BF16 CPU), also
    # round the probabilities to bf16 for P.V (flash attention's practice): measured within
    # the same bound (largest errors ~8e-3 on values of ~2, as the output rounding alone).
    exact = decode | CHUNK_KERNEL_HERE
    torch.testing.assert_close(out[exact].float(), ref[exact], atol=1e-2, rtol=2 ** -8)
    return out, ref, decode, (kc, vc), (ref_k, ref_v)


@pytest.mark.parametrize("spec,heads,kv_heads,head_dim", [
    (MIXED, 9, 3, 64), (LONG_DECODES, 8, 2, 128), (DECODES, 6, 3, 48)])
def test_bfloat16_cache_matches_a_float32_reference_on_the_same_values(spec, heads, kv_heads,
                                                                        head_dim):
    """A bfloat16 KV cache: the kernel computes in float32 and rounds only its output, so it
    matches float32 attention over the same (bf16) values to bf16's output rounding."""
    layout = make_layout(spec, 32, contiguous=False)
    out, ref, decode, (kc, vc), (ref_k, ref_v) = _bf16_step(layout, heads, kv_heads, head_dim)
    # Without the chunk kernel, chunks go through PyTorch's bf16 SDPA, which rounds inside too.
    torch.testing.assert_close(out[~decode].float(), ref[~decode], atol=3e-2, rtol=3e-2)
    assert torch.equal(kc.float(), ref_k) and torch.equal(vc.float(), ref_v)


# The AVX512_BF16 path (paged_decode_bf16.h) where the CPU has it: head sizes 64 and 128, runs
# of 16 tokens cut by blocks smaller, equal and larger than a run (attention_cases'
# KERNEL_DECODES), every query-head group shape of DECODE_HEADS. Elsewhere, and for the head
# sizes it leaves, the AVX2 path (paged_decode_avx2.h) on any x86-64-v3 CPU: runs of 8 tokens
# (blocks of 12 cut every other one short), 64-column slices of a head (Gemma 3's 256: four;
# Phi-3's 96: one and a half); a head size that is not a multiple of 8 (20): the generic loop.
@pytest.mark.parametrize("block_size", [8, 12, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         DECODE_HEADS + [(4, 2, 256), (6, 3, 96), (4, 2, 20)])
def test_bfloat16_decodes_every_block_size_and_group(block_size, heads, kv_heads, head_dim):
    _bf16_step(make_layout(KERNEL_DECODES, block_size, contiguous=False), heads, kv_heads,
               head_dim)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 5])),
                  min_size=1, max_size=6),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 2, 3, 4, 5, 8]),
    head_dim=st.sampled_from([64, 128]),
    seed=st.integers(0, 100),
)
def test_bfloat16_decodes_random_batches(spec, block_size, group, head_dim, seed):
    assume(fits_pool(spec, block_size))
    _bf16_step(make_layout(spec, block_size, contiguous=False, seed=seed), 2 * group, 2,
               head_dim)


# The bf16 chunk kernel (chunk_attention_bf16.c): attention_cases.CHUNKS; blocks shorter than a
# tile (8), equal (16) and longer (32, 48); every GQA group shape; head sizes 64 and 128.
@needs_chunk_kernel
@pytest.mark.parametrize("block_size", [8, 16, 32, 48])
@pytest.mark.parametrize("heads,kv_heads,head_dim", CHUNK_HEADS)
def test_bfloat16_chunks_every_block_size_and_group(block_size, heads, kv_heads, head_dim):
    layout = make_layout(CHUNKS, block_size, contiguous=False)
    backend = CpuPagedAttention(heads, kv_heads, head_dim)
    from chunkserve.model.batch import DeviceStager

    assert backend.build_metadata(DeviceStager(torch.device("cpu")).to_device(layout)).chunk_args
    _bf16_step(layout, heads, kv_heads, head_dim)


@needs_chunk_kernel
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 120), st.integers(1, 70)), min_size=1, max_size=5),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    seed=st.integers(0, 100),
)
def test_bfloat16_chunks_random_batches(spec, block_size, group, head_dim, seed):
    assume(fits_pool(spec, block_size))
    _bf16_step(make_layout(spec, block_size, contiguous=False, seed=seed), 2 * group, 2,
               head_dim)


@needs_chunk_kernel
def test_bfloat16_chunk_of_a_long_prompt():
    """A 600-token chunk after 700 cached: tasks far more than threads, keys over many tiles
    (the online softmax rescales its running output dozens of times)."""
    from attention_cases import NUM_BLOCKS as n

    block_size = -(-1300 // (n - 4))  # the whole context within the shared pool of blocks
    _bf16_step(make_layout([(700, 600), (0, 1)], block_size, contiguous=False), 9, 3, 64)


def test_mixed_dtypes_are_refused():
    layout = make_layout(DECODES, 16, contiguous=True)
    backend = CpuPagedAttention(4, 2, 16)
    q = torch.zeros(layout.num_tokens, 4, 16)
    cache = torch.zeros(NUM_BLOCKS, 16, 2, 16, dtype=torch.bfloat16)
    from chunkserve.model.batch import DeviceStager

    meta = backend.build_metadata(DeviceStager(torch.device("cpu")).to_device(layout))
    with pytest.raises(TypeError, match="all float32 or all bfloat16"):
        backend.forward(q, q[:, :2].to(torch.bfloat16), q[:, :2].to(torch.bfloat16), cache,
                        cache, meta)


def test_unwritable_cache_is_a_clear_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should go
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(blocker))
    with pytest.raises(cpu_library.KernelBuildError, match="cannot write"):
        cpu_library._build(cpu_library._compiler(), "native")


def test_explicit_cpu_backend_without_a_kernel_is_a_value_error(monkeypatch):
    """`--attention-backend cpu` where the kernel cannot build: a message, not a traceback (the
    command line reports ValueErrors)."""
    from chunkserve.model.attention.select import make_attention_backend

    def no_compiler(target: str | None = None) -> None:
        raise cpu_library.KernelBuildError("found no C compiler")

    monkeypatch.setattr(cpu_library, "load", no_compiler)
    with pytest.raises(ValueError, match="no C compiler"):
        make_attention_backend("cpu", 4, 2, 8, torch.device("cpu"))
