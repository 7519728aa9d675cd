"""`--kv-cache-dtype fp8`: K/V stored one byte a value (E4M3 or E5M2, unscaled, as vLLM without
calibrated scales), and `bfloat16` under a float32 model: two bytes a value; read by the CPU
kernels and the torch reference."""
from __future__ import annotations

import pytest
import torch
from attention_cases import DECODES, MIXED, NUM_BLOCKS, make_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve import LLM, SamplingParams
from chunkserve.config import KV_CACHE_DTYPES, EngineConfig
from chunkserve.engine.model_runner import kv_bytes_per_block, kv_cache_dtype
from chunkserve.model.attention.backend import KV_DTYPE_BY_NAME
from chunkserve.model.attention.cpu_backend import CpuPagedAttention
from chunkserve.model.attention.torch_backend import TorchPagedAttention
from chunkserve.model.batch import DeviceStager
from chunkserve.model import factory
from chunkserve.model.factory import load_model
from test_token_identity import _prompts

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's tests")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _step(backend, layout, heads: int, kv_heads: int,  # type: ignore[no-untyped-def]
          head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, seed: int = 1,
          v: torch.Tensor | None = None, window: int = 0):
    """(out, k_cache, v_cache) of one step on random data: q/k/v in q_dtype, caches in kv_dtype
    (the same arguments give the same data). `v`: the step's new V rows instead of random;
    `window`: a sliding window (0: none)."""
    gen = torch.Generator().manual_seed(seed)
    T = layout.num_tokens
    shape = (NUM_BLOCKS, layout.block_size, kv_heads, head_dim)
    q, k, v_new = (torch.randn(s, generator=gen).to(q_dtype) for s in (
        (T, heads, head_dim), (T, kv_heads, head_dim), (T, kv_heads, head_dim)))
    kc, vc = (torch.randn(shape, generator=gen).to(kv_dtype) for _ in range(2))
    meta = backend.build_metadata(DeviceStager(torch.device("cpu")).to_device(layout),
                                  window or None)
    with torch.inference_mode():
        out = backend.forward(q, k, v_new if v is None else v, kc, vc, meta)
    return out, kc, vc


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _against_torch(layout, heads: int, kv_heads: int,  # type: ignore[no-untyped-def]
                   head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                   seed: int = 1, window: int = 0) -> None:
    """The CPU kernels against the torch reference (which widens the fp8 K/V to q's dtype and
    runs SDPA): the same bytes written, the same outputs (float32: to 1e-5; bfloat16: to the
    output's rounding, as the bfloat16 cache tests)."""
    out, kc, vc = _step(CpuPagedAttention(heads, kv_heads, head_dim), layout, heads, kv_heads,
                        head_dim, q_dtype, kv_dtype, seed, window=window)
    ref, ref_k, ref_v = _step(TorchPagedAttention(heads, kv_heads, head_dim), layout, heads,
                              kv_heads, head_dim, q_dtype, kv_dtype, seed, window=window)
    assert torch.equal(_bytes(kc), _bytes(ref_k)) and torch.equal(_bytes(vc), _bytes(ref_v))
    if q_dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec,block_size,heads,kv_heads,head_dim", [
    (MIXED, 16, 9, 3, 64), (DECODES, 8, 8, 2, 128), (MIXED, 32, 6, 3, 48),
    ([(299, 1), (700, 1), (40, 30), (0, 17)], 16, 16, 2, 64)])
def test_fp8_cache_matches_the_torch_reference(spec, block_size, heads, kv_heads, head_dim,
                                               q_dtype, kv_dtype):
    _against_torch(make_layout(spec, block_size, contiguous=False), heads, kv_heads, head_dim,
                   q_dtype, kv_dtype)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 5, 20])),
                  min_size=1, max_size=5),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    kv_dtype=st.sampled_from(FP8),
    seed=st.integers(0, 100),
)
def test_fp8_cache_random_batches(spec, block_size, group, head_dim, kv_dtype, seed):
    _against_torch(make_layout(spec, block_size, contiguous=False, seed=seed), 2 * group, 2,
                   head_dim, torch.bfloat16, kv_dtype, seed)


def _every_finite_value(dtype: torch.dtype) -> torch.Tensor:
    """The 256 byte patterns of an fp8 format as float32, NaNs and infinities replaced by 1."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.where(values.isfinite(), values, torch.ones(()))


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_value_is_read_exactly(q_dtype, kv_dtype):
    """A decode with one key, and a chunk's first row (which sees only key 0), output their V
    row exactly: here the 256 values of the format (4 KV heads x 64), subnormals and signed
    zeros included, through the kernels' widening (table or vector rule)."""
    layout = make_layout([(0, 1), (0, 2)], 16, contiguous=False)
    v = _every_finite_value(kv_dtype).reshape(1, 4, 64).repeat(3, 1, 1)
    out, _, _ = _step(CpuPagedAttention(4, 4, 64), layout, 4, 4, 64, q_dtype, kv_dtype,
                      v=v.to(q_dtype))
    for row in (0, 1):  # the decode; the chunk's first query row
        assert torch.equal(out[row].float(), v[0].reshape(256)), row


@pytest.mark.parametrize("spec,block_size,heads,kv_heads,head_dim", [
    (MIXED, 16, 9, 3, 64), (DECODES, 8, 8, 2, 128), (MIXED, 32, 6, 3, 48),
    (MIXED, 16, 4, 1, 256), ([(299, 1), (700, 1), (40, 30), (0, 17)], 16, 16, 2, 64)])
def test_bf16_cache_under_float32_queries_matches_the_torch_reference(spec, block_size, heads,
                                                                      kv_heads, head_dim):
    """`--kv-cache-dtype bfloat16` under a float32 model (CPUs without AVX512_BF16): the decode
    kernel and the float32 chunk kernel widen the cache's values exactly, as the reference."""
    _against_torch(make_layout(spec, block_size, contiguous=False), heads, kv_heads, head_dim,
                   torch.float32, torch.bfloat16)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 5, 20, 40])),
                  min_size=1, max_size=5),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    window=st.sampled_from([0, 0, 7, 32]),
    seed=st.integers(0, 100),
)
def test_bf16_cache_random_batches_under_float32(spec, block_size, group, head_dim, window,
                                                  seed):
    layout = make_layout(spec, block_size, contiguous=False, seed=seed)
    _against_torch(layout, 2 * group, 2, head_dim, torch.float32, torch.bfloat16, seed,
                   window)


def test_narrow_caches_shrink_the_block_bytes_and_need_a_backend_that_reads_them(
        tiny_model_dir):
    model = load_model(tiny_model_dir, "float32", max_model_len=256).model
    fp8 = kv_cache_dtype(model, "fp8")
    assert fp8 == torch.float8_e4m3fn and kv_cache_dtype(model, "fp8_e5m2") == torch.float8_e5m2
    assert kv_cache_dtype(model, "auto") == model.kv_dtype == torch.float32
    assert kv_bytes_per_block(model, 16, fp8) * 4 == kv_bytes_per_block(model, 16)
    bf16 = kv_cache_dtype(model, "bfloat16")
    assert bf16 == torch.bfloat16 and kv_bytes_per_block(model, 16, bf16) * 2 == \
        kv_bytes_per_block(model, 16)
    model.attn.supports_narrow_kv_cache = False  # on the instance: as the triton backend's class
    for name in ("fp8", "bfloat16"):
        with pytest.raises(ValueError, match="not supported by the"):
            kv_cache_dtype(model, name)
    model.kv_dtype = torch.bfloat16  # the model's own dtype is not narrower: any backend
    assert kv_cache_dtype(model, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="int8")
    assert ("auto", *KV_DTYPE_BY_NAME) == KV_CACHE_DTYPES  # every name the flag takes has one


@pytest.mark.parametrize("backend,cache", [("cpu", "fp8"), ("torch", "fp8"), ("cpu", "bfloat16")])
def test_narrow_cache_tokens_do_not_depend_on_chunks_or_preemption(tiny_model_dir, backend,
                                                                   cache):
    """Greedy tokens of a tiny random float32 model on an fp8 (or bfloat16) cache: the same with
    one-step prefills, chunks of 16, and preemption by recompute (the cache is rewritten from
    the same rounded K/V every time) or by swap (its bytes go to the host pool and back), on
    either CPU backend."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts([31, 31, 31, 31, 31, 31, 47, 15])  # test_token_identity: crowded
    results = []
    for budget, blocks, mode in ((4096, None, "recompute"), (16, None, "recompute"),
                                 (32, 16, "recompute"), (32, 16, "swap")):
        loaded = load_model(tiny_model_dir, "float32", max_model_len=256,
                            attention_backend=backend)
        llm = LLM(loaded=loaded, model=loaded.path, max_num_batched_tokens=budget,
                  kv_cache_dtype=cache, num_kv_blocks=blocks, preemption_mode=mode,
                  enable_prefix_caching=False)
        runner = llm.engine.executor
        assert runner.kv_cache.dtype == KV_DTYPE_BY_NAME[cache]
        assert mode == "recompute" or runner.swap_cache.dtype == KV_DTYPE_BY_NAME[cache]
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if blocks:
            assert llm.engine.scheduler.num_preemptions > 0
    assert all(r == results[0] for r in results)


def test_auto_dtype_keeps_a_16_bit_cache_where_activations_are_float32(tiny_model_dir,
                                                                      monkeypatch):
    """`--dtype auto` on a CPU without AVX512_BF16 runs float32 activations over a bfloat16
    cache (factory.AUTO_CPU_KV_DTYPE), as a bf16 CPU runs both in bf16; an explicit float32
    keeps a float32 cache, and so does `--kv-cache-dtype` naming one of the others."""
    monkeypatch.setattr(factory, "cpu_has_avx512_bf16", lambda: False)
    auto = load_model(tiny_model_dir, "auto", max_model_len=256, quantization="none").model
    assert auto.dtype == torch.float32
    assert kv_cache_dtype(auto, "auto") == factory.AUTO_CPU_KV_DTYPE == torch.bfloat16
    assert kv_bytes_per_block(auto, 16, kv_cache_dtype(auto, "auto")) * 2 == \
        kv_bytes_per_block(auto, 16, torch.float32)
    assert kv_cache_dtype(auto, "fp8") == torch.float8_e4m3fn
    explicit = load_model(tiny_model_dir, "float32", max_model_len=256).model
    assert kv_cache_dtype(explicit, "auto") == torch.float32


# ---- the default model: what fp8 costs in accuracy ---------------------------------------------
def test_smollm2_fp8_cache_accuracy_against_float32(smollm2_path, smollm2_fp32):
    """The default configuration (bf16 activations, int4 weights) with an E4M3 cache, against
    float32 weights and cache. Measured on the 10 greedy prompts (docs/performance.md): max
    |dlogit| 1.02-3.45 and top-1 agreement 0.83-1.0 over all positions (bf16 cache: 0.29-0.48,
    1.0; E5M2: 1.96-7.23, 0.75-0.94); 8 greedy tokens' common prefix with float32
    [8, 8, 8, 8, 5, 1, 8, 8, 8, 3] (bf16 cache: [8, 8, 8, 8, 8, 1, 8, 8, 3, 3])."""
    from test_model_parity import full_logits
    from test_quantization import GREEDY_PROMPTS, PROMPTS

    fp32 = smollm2_fp32  # float32 weights, no quantization (conftest)
    default = load_model(smollm2_path, "auto", max_model_len=512, quantization="auto")
    for text in PROMPTS:
        ids = fp32.tokenizer.encode(text)
        ref = full_logits(fp32.model, ids)
        out = full_logits(default.model, ids, chunk=4, kv_dtype=torch.float8_e4m3fn)
        assert (out - ref).abs().max().item() <= 4.0
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [fp32.tokenizer.encode(t) for t in GREEDY_PROMPTS]
    ref = [o.outputs[0].token_ids for o in LLM(loaded=fp32, model=fp32.path).generate(ids, params)]
    got = [o.outputs[0].token_ids for o in LLM(loaded=default, model=default.path,
                                               kv_cache_dtype="fp8").generate(ids, params)]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(ref, got)]
    assert sum(p > 0 for p in prefix) >= 9 and sum(p == 8 for p in prefix) >= 5
