"""`--quantization int4` (and `auto` on 4-bit weights): groups of 32 with scale and minimum."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_model_parity import full_logits
from test_quantization import C_KERNELS, INT8_ROWS, KERNELS, int8_activations, on_kernel

from chunkserve.model.factory import LoadedModel, cpu_has_avx512_bf16, load_model
from chunkserve.model.layers import group_gemm
from chunkserve.model.layers.linear import Int8Linear, make_linear
from chunkserve.model.layers.linear_int4 import (GROUP, Int4Linear, dequantize_int4,
                                          exact_int4, quantize_int4)

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


def q4_1_like(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A tensor as a Q4_1 GGUF dequantizes to: per block of 32, minimum + level * scale, the
    levels spanning 0..15 (llama.cpp's quantizer puts the block's min and max at 0 and 15)."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=gen)
    levels[..., 0], levels[..., 1] = 0, 15
    # float16 scales and minimums, as the file stores them
    scale = (torch.rand(n, k // GROUP, 1, generator=gen) * 0.02 + 1e-3).half().float()
    low = (-torch.rand(n, k // GROUP, 1, generator=gen) * 0.1).half().float()
    return (low + levels * scale).reshape(n, k)


def test_q4_1_weights_come_back_exactly():
    w = q4_1_like(64, 96)
    levels, scale, low = quantize_int4(w)
    assert levels.min() >= 0 and levels.max() <= 15
    torch.testing.assert_close(dequantize_int4(levels, scale, low), w, rtol=0, atol=1e-6)
    exact = exact_int4(w)
    assert exact is not None and torch.equal(exact[0], levels)
    assert exact_int4(torch.randn(64, 96)) is None  # ordinary weights are not 4-bit
    assert exact_int4(torch.randn(64, 90)) is None  # rows not a whole number of groups


def q4_0_like(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Blocks as gguf's Q4_0 packer writes them, dequantized: (q - 8) d, d of either sign."""
    from gguf import GGMLQuantizationType, dequantize, quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    blocks = dequantize(quantize(w, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    return torch.from_numpy(blocks.copy()).float()


def test_q4_0_weights_come_back_exactly():
    # Q4_0 blocks as llama.cpp writes them (gguf's packer): (q - 8) * d, the largest |w| at
    # q = 0 with d of either sign, the other end of the grid mostly unused.
    q4_0 = q4_0_like(64, 256, seed=3)
    exact = exact_int4(q4_0)
    assert exact is not None
    torch.testing.assert_close(dequantize_int4(*exact), q4_0, rtol=0, atol=1e-6)
    # Q4_0's own form, d of either sign: every minimum exactly -8 scales (the avx2 kernel's
    # centred skip), where the per-group search gave d < 0 groups a flipped grid.
    levels, scale, low = exact
    assert torch.equal(low, -8 * scale) and (scale < 0).any() and (scale > 0).any()
    # The min/max grid of these groups would not have given them back.
    levels, scale, low = quantize_int4(q4_0)
    assert (dequantize_int4(levels, scale, low) - q4_0).abs().max() > 1e-3


def test_a_tensor_not_all_q4_0_keeps_the_per_group_grids():
    """Q4_0's form is taken for a whole tensor or not at all: one Q4_1 group among Q4_0 ones
    sends every group to the per-group search, which still gives each back exactly (a whole
    Q4_1 tensor: test_q4_1_weights_come_back_exactly). All-zero groups keep d = 0."""
    w = q4_0_like(32, 128, seed=5)
    w[3, :GROUP] = q4_1_like(1, GROUP, seed=1)[0]
    exact = exact_int4(w)
    assert exact is not None and not torch.equal(exact[2], -8 * exact[1])
    torch.testing.assert_close(dequantize_int4(*exact), w, rtol=0, atol=1e-6)
    zeros = q4_0_like(16, 64, seed=2)
    zeros[0] = 0.0  # all-zero groups: d = 0, levels 8
    levels, scale, low = exact_int4(zeros)  # type: ignore[misc]
    assert torch.equal(dequantize_int4(levels, scale, low), zeros) and (scale[0] == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 7, 25, 64])
def test_q4_0_weights_of_either_sign_run_on_every_kernel(kernel, rows, monkeypatch):
    """Negative scales (Q4_0's d < 0) with minimums of -8 scales, through `auto` on each
    kernel, decode and prefill rows alike (bf16 activations where the kernel takes them)."""
    w = q4_0_like(48, 256, seed=rows)
    dtype = torch.float32 if kernel == "avx2" else torch.bfloat16
    lin = on_kernel(lambda: make_linear(w, "auto", dtype), kernel, monkeypatch)
    assert isinstance(lin, Int4Linear)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = F.linear(x.float(), w)
    torch.testing.assert_close(lin(x).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_any_weight_rounds_to_half_a_step():
    w = torch.randn(48, 64) * torch.linspace(0.01, 2.0, 48)[:, None]
    levels, scale, low = quantize_int4(w)
    err = (dequantize_int4(levels, scale, low) - w).abs().reshape(48, -1, GROUP)
    assert (err <= scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32, 33, 100])
def test_int4_kernel_and_dense_paths_agree(kernel, rows, dtype, monkeypatch):
    w = q4_1_like(96, 128, seed=rows)
    lin = on_kernel(lambda: Int4Linear(w, dtype), kernel, monkeypatch)
    x = torch.randn(rows, 128).to(dtype)
    ref = F.linear(x.float(), w)
    out = lin(x)
    assert out.dtype == dtype and out.shape == (rows, 96) and lin.shape == (96, 128)
    # bf16 activations, outputs and group scales in the kernel: ~2^-8 relative
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert lin.weight_bytes < w.numel()  # under a byte a weight


@pytest.mark.skipif("bf16" not in C_KERNELS, reason="the bf16 int4 kernel needs AVX512_BF16")
@pytest.mark.parametrize("n,k", [(16, 32), (100, 64), (48, 1536), (3, 96)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 32])
def test_c_int4_kernel_is_exact_on_q4_1_weights(n, k, rows, monkeypatch):
    """Float16 scales and minimums hold a Q4_1 block exactly and the products are exact in
    float32: the kernel's output is the float32 product over the same bf16 inputs, rounded
    once to bf16 (channels not a multiple of 16 are padded and dropped)."""
    w = q4_1_like(n, k, seed=n + rows)
    lin = on_kernel(lambda: Int4Linear(w, torch.bfloat16), "bf16", monkeypatch)
    x = torch.randn(rows, k).bfloat16()
    out = lin.kernel(x)
    ref = F.linear(x.float(), w)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-4 * ref.abs().max().item())


@pytest.mark.skipif("avx2" not in C_KERNELS, reason="the avx2 int4 kernel needs AVX2/FMA/F16C")
@pytest.mark.parametrize("n,k", [(16, 32), (100, 64), (48, 1536), (3, 96)])
# rows: up to 19, passes of 4 rows and their tails; from 20 on (WIDE_MIN_ROWS), tiles of 6 rows x 16
# channels (n = 100 and 3 end on 8) and each tail: 20, 21, 22, 25, 29 = 18 + 2, 3, 4; 24 + 1, 5
@pytest.mark.parametrize("rows", [1, 5, 19, 20, 21, 22, 25, 29])
def test_avx2_int4_kernel_is_exact_on_q4_1_weights(n, k, rows, monkeypatch):
    """The avx2 kernel holds a Q4_1 block exactly and sums (level - 8) x int8-activation
    products in int32; the minimums (of the centred levels) multiply the rows' float sums. Its
    output is that arithmetic in float32, to float32 rounding (channels not a multiple of 8 are padded and dropped)."""
    w = q4_1_like(n, k, seed=n + rows)
    lin = on_kernel(lambda: Int4Linear(w), "avx2", monkeypatch)
    assert torch.equal(lin.kernel.dequantized(), w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = lin.kernel(x)
    levels, scale, low = quantize_int4(w)
    lows = (low + 8 * scale).repeat_interleave(GROUP, dim=1)  # the centred levels' minimums
    ref = F.linear(int8_activations(x), w - lows) + F.linear(x, lows)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # float32 sums of up to 1,536 terms in another order, two of them cancelling: 1e-4 (one
    # activation a level off would be ~6e-4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.skipif("vnni" not in C_KERNELS, reason="the vnni kernel needs AVX512_VNNI and BF16")
@pytest.mark.parametrize("n,k", [(16, 32), (100, 64), (48, 1536), (3, 96), (80, 64)])
# rows: passes of 6 rows over two blocks of 16 channels, 8 over a lone last block (n = 48, 80)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 9, 13, 17])
def test_vnni_int4_kernel_is_exact_on_q4_1_weights(n, k, rows, monkeypatch):
    """The vnni kernel holds a Q4_1 block exactly, quantizes each bf16 row to int8 per group of
    32 and sums (level - 8) x int8 products in int32; the minimums (of the centred levels)
    multiply the rows' float sums. Its output is that arithmetic in float32, rounded once to
    bf16 (channels not a multiple of 16 are padded and dropped)."""
    w = q4_1_like(n, k, seed=n + rows)
    lin = on_kernel(lambda: Int4Linear(w, torch.bfloat16), "vnni", monkeypatch)
    assert torch.equal(lin.kernel.dequantized(), w) and lin.dense is None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by it
    out = lin.kernel(x)
    levels, scale, low = quantize_int4(w)
    lows = (low + 8 * scale).repeat_interleave(GROUP, dim=1)  # the centred levels' minimums
    ref = F.linear(int8_activations(x.float()), w - lows) + F.linear(x.float(), lows)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-4 * ref.abs().max().item())


def test_auto_takes_int4_only_where_the_weights_are_4_bit():
    assert isinstance(make_linear(q4_1_like(32, 64), "auto", torch.bfloat16), Int4Linear)
    assert isinstance(make_linear(torch.randn(32, 64), "auto", torch.bfloat16), Int8Linear)
    assert isinstance(make_linear(torch.randn(32, 64), "int4", torch.bfloat16), Int4Linear)
    with pytest.raises(ValueError, match="divisible by 32"):
        make_linear(torch.randn(32, 40), "int4")


@pytest.fixture(scope="module")
def fp32(smollm2_fp32: LoadedModel) -> LoadedModel:
    return smollm2_fp32  # float32, no quantization (conftest: one load a session)


@pytest.fixture(scope="module")
def fp32_logits(fp32: LoadedModel) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's ids and float32 logits: the reference of every dtype and chunk below."""
    return [(ids, full_logits(fp32.model, ids))
            for ids in (fp32.tokenizer.encode(text) for text in PROMPTS)]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "avx2"])
def int4(request: pytest.FixtureRequest, smollm2_path: str) -> LoadedModel:
    """One int4 load per activation dtype, shared by both chunkings (pytest runs a dtype's
    tests together and drops its model before loading the next). "avx2": float32 on the avx2
    group GEMM where the host's own kernel is another (AVX512_BF16), so both kinds of CI host
    run it."""
    if request.param != "avx2":
        return load_model(smollm2_path, request.param, max_model_len=512, quantization="int4")
    if "avx2" not in C_KERNELS or group_gemm.available().name == "avx2":
        pytest.skip("the avx2 kernel is missing here, or is the float32 case already")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(group_gemm, "available", lambda: C_KERNELS["avx2"])
        return load_model(smollm2_path, "float32", max_model_len=512, quantization="int4")


@pytest.mark.parametrize("chunk", [None, 4])  # one step (dense copy), 4-row steps (kernel)
def test_smollm2_int4_logits_stay_close_to_float32(fp32_logits, int4, chunk):
    """SmolLM2's linears are Q4_1: int4 holds them exactly (the C kernel's float16 group scales
    too; PyTorch's kernel rounds them to bf16), so the logits move less than with int8
    (measured max |d| 0.49-1.02 vs int8's 1.35-2.25; C kernel 0.61-0.84). The avx2 kernel
    also rounds the activations to int8 (per group of 32, as llama.cpp on these formats):
    1.02-1.43, still under per-channel int8's, its AVX2 predecessor (it takes every row, so
    whole-prompt steps too); the vnni kernel rounds them the same way."""
    assert isinstance(int4.model.layers[0].qkv, Int4Linear)
    assert isinstance(int4.model.lm_head, Int8Linear)  # the Q8_0 embedding is not 4-bit
    kernel = int4.model.layers[0].qkv.kernel
    int8_rows = isinstance(kernel, group_gemm.GroupGemm) and kernel.kernel.name in INT8_ROWS
    for ids, ref in fp32_logits:
        out = full_logits(int4.model, ids, chunk=chunk)
        assert (out - ref).abs().max().item() <= (1.6 if int8_rows else 1.3)
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="auto picks int4 where AVX512_BF16 is")
def test_auto_serves_a_q4_gguf_in_int4(smollm2_path):
    loaded = load_model(smollm2_path, max_model_len=512)
    assert loaded.model.quantization == "int4"  # what a profile records, to replay the same
    assert all(isinstance(layer.down, Int4Linear) for layer in loaded.model.layers)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_linear_keeps_no_dense_copy_where_memory_is_short(kernel, monkeypatch):
    """Past DENSE_RESERVE_BYTES available, a quantized linear skips its dense copy for prefill
    rows (an 8B model's would be 14 GiB in bf16): the kernel then takes every row count, with
    the dense path's results."""
    from chunkserve.model.layers import quant_linear

    w = q4_1_like(96, 128, seed=7)
    kept = on_kernel(lambda: Int4Linear(w, torch.bfloat16), kernel, monkeypatch)
    before = quant_linear.dense_copies_skipped()
    monkeypatch.setattr(quant_linear, "mem_available", lambda: quant_linear.DENSE_RESERVE_BYTES)
    lean = on_kernel(lambda: Int4Linear(w, torch.bfloat16), kernel, monkeypatch)
    # The avx2 and vnni kernels take every row anyway: they never have a copy to skip.
    assert quant_linear.dense_copies_skipped() == before + (kernel not in INT8_ROWS)
    assert lean.dense is None and lean.kernel.max_rows is None
    x = torch.randn(100, 128).bfloat16()  # a prefill chunk's rows
    ref = F.linear(x.float(), w)
    for lin in (kept, lean):
        torch.testing.assert_close(lin(x).float(), ref, rtol=2e-2,
                                   atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("make", [Int4Linear, Int8Linear], ids=["int4", "int8"])
@pytest.mark.parametrize("kernel", INT8_ROWS)
def test_a_kernel_that_takes_every_row_builds_no_dense_weights(kernel, make, monkeypatch):
    """The avx2 and vnni kernels take every row count, so a layer on them never dequantizes
    its weights at load (4 bytes a weight of time and peak memory at real sizes)."""
    if kernel not in C_KERNELS:
        pytest.skip(f"this CPU has no {kernel} group GEMM")

    def refuse(self: group_gemm.GroupGemm) -> torch.Tensor:
        raise AssertionError("a dense copy was built")

    w = q4_1_like(64, 128, seed=3)
    monkeypatch.setattr(group_gemm.GroupGemm, "dequantized", refuse)
    lin = on_kernel(lambda: make(w, torch.float32), kernel, monkeypatch)
    assert lin.dense is None and lin.shape == (64, 128)
    x = torch.randn(40, 128)  # more rows than any dense crossover
    ref = F.linear(x, w)
    torch.testing.assert_close(lin(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif("bf16" not in C_KERNELS,
                    reason="only the bf16 kernel keeps dense copies to go without (AVX512_BF16)")
def test_load_log_says_how_many_linears_went_without(smollm2_path, monkeypatch, caplog):
    from chunkserve.model.layers import quant_linear

    monkeypatch.setattr(group_gemm, "available", lambda: C_KERNELS["bf16"])
    monkeypatch.setattr(quant_linear, "mem_available", lambda: 0)
    with caplog.at_level("WARNING", logger="chunkserve.model.factory"):
        loaded = load_model(smollm2_path, max_model_len=256, quantization="int8")
    assert all(layer.down.dense is None for layer in loaded.model.layers)
    said = [r.getMessage() for r in caplog.records if "keep no dense" in r.getMessage()]
    assert said and said[0].startswith(f"{len(loaded.model.layers) * 4 + 1} linears")


@pytest.mark.skipif("avx2" not in C_KERNELS, reason="this build has no avx2 group GEMM")
def test_avx2_prefill_rows_of_q4_0_weights_match_decode_rows_bit_for_bit() -> None:
    """From 20 rows on the avx2 kernel takes its prefill path, which on Q4_0's centred
    minimums skips their (zero) term: each row comes out as the decode path gives it alone."""
    g = torch.Generator().manual_seed(1)
    d = ((torch.rand(48, 8, generator=g) * 0.02 + 0.001)
         * torch.where(torch.rand(48, 8, generator=g) < 0.5, -1.0, 1.0)).to(torch.float16)
    q = torch.randint(0, 16, (48, 8, 32), generator=g)
    q[..., 0] = 0
    w = ((q - 8).float() * d.float()[..., None]).reshape(48, 256)
    scale = d.float()  # Q4_0's own grid: minimum -8 scale, the scale of either sign
    gemm = group_gemm.GroupGemm.int4(C_KERNELS["avx2"], q.reshape(48, 256).to(torch.int32),
                                     scale, -8 * scale, max_rows=None)
    x = torch.randn(24, 256, generator=g)
    wide = gemm(x)
    for m in (0, 7, 23):
        assert torch.equal(wide[m], gemm(x[m:m + 1])[0])
    assert (wide - x @ w.T).abs().max().item() < 0.05 * (x @ w.T).abs().max().item()
