"""`chunkserve export-dummy`: presets written as GGUF files and HF folders with random weights
(issue 54), read back by chunkserve's own loaders, and the block packers against the `gguf`
package's readers."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from chunkserve.cli import main
from chunkserve.gguf_file import open_gguf
from chunkserve.model.loaders.dummy import dummy_weights
from chunkserve.model.loaders.source import load_weights
from chunkserve.model.models.registry import config_from_hf
from chunkserve.model.writers.export import export_dummy
from chunkserve.model.writers.ggml_quants import GGMLType, quantize_rows
from chunkserve.model.writers.gguf_export import QUANT_MIXES, _use_more_bits, tensor_type
from chunkserve.presets import model_preset
from chunkserve.tokenizer.sized_vocab import pad_token, sized_vocab


@pytest.mark.parametrize("qtype, rms", [(GGMLType.Q4_K, 0.1), (GGMLType.Q6_K, 0.03),
                                        (GGMLType.Q4_0, 0.1), (GGMLType.Q8_0, 0.01)])
def test_packed_blocks_read_back_close(qtype: GGMLType, rms: float) -> None:
    x = (np.random.default_rng(0).standard_normal((64, 512)) * 0.02).astype(np.float32)
    x[3] = 0.0  # an all-zero block: scales of 0, no division by zero
    back = gguf.quants.dequantize(quantize_rows(x, qtype), qtype).reshape(x.shape)
    assert np.all(back[3] == 0)
    assert np.sqrt(np.mean((back - x) ** 2)) / x.std() < rms


def test_q4_k_m_mix_is_llama_quantizes() -> None:
    mix = QUANT_MIXES["q4_k_m"]
    assert tensor_type("output.weight", (128256, 2048), mix, 16, False) == GGMLType.Q6_K
    assert tensor_type("token_embd.weight", (128256, 2048), mix, 16, True) == GGMLType.Q6_K
    assert tensor_type("token_embd.weight", (128256, 2048), mix, 16, False) == GGMLType.Q4_K
    assert tensor_type("blk.0.attn_v.weight", (512, 2048), mix, 16, True) == GGMLType.Q6_K
    assert tensor_type("blk.3.attn_v.weight", (512, 2048), mix, 16, True) == GGMLType.Q4_K
    assert tensor_type("blk.0.attn_norm.weight", (2048,), mix, 16, True) == GGMLType.F32
    # Rows that are not whole 256-value super-blocks fall back as llama.cpp's do.
    assert tensor_type("blk.3.attn_q.weight", (64, 64), mix, 16, True) == GGMLType.Q5_0
    assert [i for i in range(16) if _use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_sized_vocab_pads_and_truncates() -> None:
    big = sized_vocab(49152 + 100)
    assert len(big.tokens) == len(big.token_types) == 49252
    assert big.tokens[-1] == pad_token(49251) and big.token_types[-1] == 5
    small = sized_vocab(32000)
    assert len(small.tokens) == 32000 and max(small.tokenizer_json["model"]["vocab"].values()) == 31999
    kept = set(small.tokens)
    assert all(m.replace(" ", "") in kept for m in small.merges)
    with pytest.raises(ValueError, match="too small"):
        sized_vocab(100)


@pytest.mark.parametrize("quant", ["q4_k_m", "q4_0", "q8_0", "bf16"])
def test_gguf_export_loads_back(tmp_path, quant: str) -> None:
    done = export_dummy("tiny-llama", "gguf", str(tmp_path / "m"), quant, seed=3)
    assert done.path.endswith(f"tiny-llama-{quant}.gguf") and os.path.isfile(done.path)
    assert os.listdir(tmp_path) == ["m"]  # no partial folder left
    config, weights = load_weights(done.path)
    assert config.vocab_size == 49152 and config.num_hidden_layers == 2
    reference = dummy_weights(config_from_hf(model_preset("tiny-llama")), 3,
                              torch.device("cpu"), torch.bfloat16)
    # The q/k rows come back in HF's order: the values are the preset's, as quantized.
    tol = {"q4_k_m": 0.15, "q4_0": 0.15, "q8_0": 0.02, "bf16": 1e-6}[quant]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        got, want = weights[name], reference[name].float()
        assert (got - want).pow(2).mean().sqrt() / want.std() < tol, name


def test_gguf_export_llama3_rope_and_tied(tmp_path, monkeypatch) -> None:
    # A Llama 3.2 config at a test's size: rope_freqs, tied embeddings, 128256 ids.
    from chunkserve.model.writers import export as export_module

    preset = model_preset("llama-3.2-1b")
    preset.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    monkeypatch.setattr(export_module, "model_preset", lambda name: preset)
    done = export_dummy("llama-3.2-1b", "gguf", str(tmp_path / "m"), "q4_0")
    names = {t.name: t for t in open_gguf(done.path).tensors}
    assert "rope_freqs.weight" in names and "output.weight" not in names
    config, _ = load_weights(done.path)
    assert config.rope_scaling["rope_type"] == "llama3" and config.tie_word_embeddings
    assert config.vocab_size == 128256


def test_hf_export_is_the_presets_weights(tmp_path) -> None:
    done = export_dummy("tiny-llama", "hf", str(tmp_path / "m"), seed=5)
    assert sorted(os.listdir(done.path)) == ["config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json"]
    config, weights = load_weights(done.path)
    reference = dummy_weights(config, 5, torch.device("cpu"), torch.bfloat16)
    for name, tensor in reference.items():
        assert torch.equal(weights[name].to(torch.bfloat16), tensor), name
    # Every file as readable as the config beside it (safetensors alone leaves shards 0600:
    # a server running as another user could not read them).
    mode = os.stat(os.path.join(done.path, "config.json")).st_mode & 0o777
    assert os.stat(os.path.join(done.path, "model.safetensors")).st_mode & 0o777 == mode


def test_exported_gguf_generates(tmp_path) -> None:
    from chunkserve import LLM, SamplingParams

    done = export_dummy("tiny-llama", "gguf", str(tmp_path / "m"), "q8_0")
    llm = LLM(model=done.path, max_num_batched_tokens=32, dtype="float32")
    try:
        out = llm.generate("Hello there", SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.engine.close()


def test_bad_input_is_a_one_line_error(tmp_path, capsys) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    cases = [(["export-dummy", "llama-9", "--out", str(tmp_path / "a")], "unknown model preset"),
             (["export-dummy", "tiny-llama", "--out", str(taken)], "not an empty folder"),
             (["export-dummy", "tiny-llama", "--quant", "q3_k", "--out", str(tmp_path / "b")],
              "quantization 'q3_k' is not supported"),
             (["export-dummy", "tiny-llama", "--format", "hf", "--quant", "q4_0",
               "--out", str(tmp_path / "c")], "not supported for hf"),
             (["export-dummy", "gemma-3-270m", "--out", str(tmp_path / "d")], "use --format hf")]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["taken"]  # nothing half-written


def test_export_dummy_command_writes_into_an_empty_folder(tmp_path, capsys) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["export-dummy", "tiny-llama", "--quant", "q4_0", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "tiny-llama-q4_0.gguf")
