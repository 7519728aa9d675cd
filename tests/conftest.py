"""Shared fixtures: the real SmolLM2 GGUF, transformers' own readings of it (its tokenizer, its
dequantized tensors) and a tiny random-weight Llama in a HF folder."""
from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The step-time model's warm-start cache (sim/online_model.py): one per test session, shared
# with the servers it starts, never the user's ~/.cache/chunkserve.
os.environ.setdefault("CHUNKSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="chunkserve-cache-"))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter (numpy, slow): the variable must be
# set before triton is first imported. On a GPU they compile and run for real.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from chunkserve.model.loaders.source import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path: str) -> Any:
    """Our SmolLM2 in float32, dense (no quantization), 512 positions: the reference of the
    parity, quantization, KV-dtype and token-identity tests, loaded once a session. Tests run
    it through their own runners and engines and never change it."""
    from chunkserve.model.factory import load_model

    return load_model(smollm2_path, "float32", max_model_len=512, quantization="none")


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path: str) -> Any:
    """transformers' tokenizer from the SmolLM2 GGUF (its own conversion of the file's
    vocabulary, seconds of work): one for the session. Tests read it; one that changes it
    puts back what it changed."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path)
    )


@pytest.fixture(scope="session")
def smollm2_hf_checkpoint(smollm2_path: str) -> dict[str, Any]:
    """transformers' reading of the SmolLM2 GGUF, as {"config", "tensors", ...}: its metadata
    parse, gguf-py's dequantization and its own q/k un-permutation, float32, nothing of ours
    shared. Over 10 s a reading, so one for the session (test_loaders.py compares our weights
    with the tensors, test_model_parity.py runs transformers' Llama on them); read-only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from chunkserve.presets import model_preset

    # The skeleton only names the tensors (GGUF -> HF names), from SmolLM2's config.json (the
    # smollm2-135m preset), so the file is parsed once; the head counts transformers'
    # un-permutation uses come from that parse (checkpoint["config"]).
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**model_preset("smollm2-135m")))
    return load_gguf_checkpoint(smollm2_path, return_tensors=True, model_to_load=skeleton,
                                torch_dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: Any) -> str:
    """A 2-layer random Llama (GQA, untied head) with SmolLM2's tokenizer, saved as safetensors.

    The larger init range makes the random logits peaked, so greedy decoding has clear winners
    and token-identity tests compare scheduling, not floating-point coin flips.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = smollm2_hf_tokenizer
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
