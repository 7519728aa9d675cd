"""Logits parity with an independent implementation: HF transformers on the same weights."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from chunkserve.core.request import Request
from chunkserve.core.sched_output import ScheduledRequest
from chunkserve.engine.model_runner import ModelRunner, kv_cache_groups
from chunkserve.sampling_params import SamplingParams
from chunkserve.model.factory import LoadedModel, load_model
from chunkserve.model.models import llama


def full_logits(model: llama.LlamaForCausalLM, ids: list[int], chunk: int | None = None,
                kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits at every position, running the prompt through the paged cache in chunks (a KV
    cache of `kv_dtype`; None: the model's dtype), as the engine's runner does: each KV-cache
    group its own blocks, none freed, so a sliding window is the attention backend's alone."""
    block_size = 16
    n = len(ids)
    per_group = -(-n // block_size)
    num_groups = kv_cache_groups(model).num_groups
    runner = ModelRunner(model, num_kv_blocks=num_groups * per_group, block_size=block_size,
                         kv_dtype=kv_dtype)
    tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(num_groups)]
    request = Request("r", ids, SamplingParams(max_tokens=1), arrival_time=0.0)
    chunk = chunk or n
    parts = []
    for start in range(0, n, chunk):
        step = [ScheduledRequest(request, min(chunk, n - start), start, is_decode=False,
                                 block_tables=tables, samples=False)]
        hidden = runner.hidden_states(step)
        parts.append(model.compute_logits(hidden))
    return torch.cat(parts)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_hf_checkpoint: dict[str, Any]) -> Any:
    """transformers' Llama on transformers' own reading of the GGUF (its own dequantization
    and q/k un-permutation, conftest), so nothing of ours is shared with the reference."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    parsed, tensors = smollm2_hf_checkpoint["config"], smollm2_hf_checkpoint["tensors"]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
            "max_position_embeddings")
    config = LlamaConfig(**{k: parsed[k] for k in keys}, tie_word_embeddings=True)
    with no_init_weights():  # every weight is loaded next (copied: the session's stay as read)
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model.float().eval()


@pytest.fixture(scope="module")
def prompt64(smollm2_fp32: LoadedModel) -> list[int]:
    text = (
        "Chunked prefill splits a long prompt into pieces under a per-step token budget, so "
        "that the requests already decoding keep receiving a token every step instead of "
        "waiting behind one enormous prefill. The cost is a longer time to first token, "
        "because the prompt now needs several steps before its first token finally appears."
    )
    ids = smollm2_fp32.tokenizer.encode(text)
    assert len(ids) >= 64
    return ids[:64]


def test_smollm2_logits_match_transformers(smollm2_fp32, hf_smollm2, prompt64):
    ours = full_logits(smollm2_fp32.model, prompt64)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([prompt64])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-3


def test_chunked_prefill_logits_match_whole(smollm2_fp32, prompt64):
    whole = full_logits(smollm2_fp32.model, prompt64)
    # Float32 rounding only: a GEMM over 7 rows sums in another order than one over 64 (the
    # BLAS picks its kernel by shape), and 30 layers carry it. Bound relative to the largest
    # logit, ~40 ulps of it: measured 2.7e-6-3.3e-6 on an AVX-512 host; earlier AVX2 hosts stayed under 1e-4 (2.6e-6).
    scale = whole.abs().max().item()
    for chunk in (7, 16, 33):
        chunked = full_logits(smollm2_fp32.model, prompt64, chunk=chunk)
        assert (chunked - whole).abs().max().item() <= 5e-6 * scale, chunk


def test_tiny_hf_folder_matches_transformers(tiny_model_dir: str):
    from transformers import AutoModelForCausalLM

    loaded = load_model(tiny_model_dir, "float32", max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = list(range(1000, 1100))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(loaded.model, ids, chunk=30) - ref).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    """Llama-3.1 rope scaling: frequencies and logits equal transformers' on a random model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from chunkserve.model.loaders.safetensors import load_hf_dir

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    torch.manual_seed(1)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    cfg, weights = load_hf_dir(str(tmp_path))
    ours = llama.LlamaForCausalLM(cfg, weights, torch.float32, max_positions=1024)
    ids = [(i * 37) % 256 for i in range(300)]  # past the original 64 positions
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(ours, ids, chunk=100) - ref).abs().max().item() <= 1e-4


def test_bfloat16_linears_track_float32(smollm2_path, smollm2_fp32, prompt64):
    """The bfloat16 path (the default on AVX512_BF16 CPUs: weights, activations into the
    GEMMs and the KV cache in bfloat16) stays close to float32."""
    bf16 = load_model(smollm2_path, "bfloat16", max_model_len=512)
    assert bf16.model.dtype == torch.bfloat16 and bf16.model.kv_dtype == torch.bfloat16
    ref = full_logits(smollm2_fp32.model, prompt64)
    # Chunks of 16 (PyTorch's SDPA), and one token a step (the CPU backend's decode kernel).
    # Measured on an AMX host: cosine >= 0.9997, greedy agreement 0.94 and 0.92.
    for chunk in (16, 1):
        got = full_logits(bf16.model, prompt64, chunk=chunk)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert cos.min().item() > 0.99, chunk
        # The greedy choice agrees at nearly every position.
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9, chunk
