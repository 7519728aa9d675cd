"""`--load-format dummy` and model presets: random weights of a model's shape, no download."""
from __future__ import annotations

import ast
import gzip
import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from chunkserve.model.loaders import source
from chunkserve.model.loaders.dummy import INIT_STD, dummy_weights
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import config_from_hf
from chunkserve.model.loaders.source import expected_shapes, load_source, load_source_tokenizer
from chunkserve.tokenizer.tokenizer import (
    BUNDLED_TOKENIZER_DIR,
    Tokenizer,
    load_bundled_tokenizer,
    load_tokenizer,
)
from chunkserve.presets import model_preset, model_preset_names
from chunkserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
TEXTS = [
    "Hello world",
    "a 12 b, 3.14159 and 2,000,000  x  1",
    "héllo wörld — naïve café 日本語のテキスト",
    "emoji 🚀🔥👍🏽 done",
    "def f(x):\n    return x + 1\n\n\tpass  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>x<repo_name>",
    "  leading and trailing   \r\n",
    "",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🙂"}],
]


@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    return load_bundled_tokenizer()


def tiny_config(**changes: Any) -> DecoderConfig:
    return config_from_hf({**model_preset("tiny-llama"), **changes})


def _llm(**kwargs: Any) -> Any:
    from chunkserve import LLM

    defaults = {"model": "tiny-llama", "max_num_batched_tokens": 64, "dtype": "float32"}
    return LLM(**{**defaults, **kwargs})


# --- presets ------------------------------------------------------------------------------------

def test_presets_are_runnable_configs() -> None:
    names = model_preset_names()
    assert {"llama-3-8b", "llama-3-70b", "llama-2-13b", "mistral-7b", "tiny-llama"} <= set(names)
    for name in names:
        config = config_from_hf(model_preset(name))
        assert config.bos_token_id is not None and config.eos_token_ids, name
    llama3 = config_from_hf(model_preset("llama-3-8b"))
    assert (llama3.vocab_size, llama3.rope_theta, llama3.rms_norm_eps) == (128256, 500000.0, 1e-5)
    assert llama3.eos_token_ids == [128001]
    preset = model_preset("tiny-llama")
    preset["vocab_size"] = 1  # a copy: the next caller still gets the file's values
    assert model_preset("tiny-llama")["vocab_size"] == 49152


def test_presets_module_is_a_leaf() -> None:
    # The simulator and the loader both read it; it must not drag either into the other.
    import chunkserve.presets

    tree = ast.parse(Path(chunkserve.presets.__file__).read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.split(".")[0] == "chunkserve"]


def test_sim_reads_the_same_presets() -> None:
    from chunkserve.sim.specs import get_model, model_names

    assert model_names() == model_preset_names()
    spec = get_model("llama-3-8b")  # the engine-only keys (rope_theta, ...) are skipped
    assert (spec.hidden_size, spec.num_key_value_heads, spec.vocab_size) == (4096, 8, 128256)
    assert get_model("tiny-llama").dim == 16


def test_unknown_model_names_the_presets() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'; presets: .*tiny-llama"):
        model_preset("llama-9")
    expected = r"'llama-9' not found: .*model preset .*llama-3-8b.*tiny-llama"
    with pytest.raises(ValueError, match=expected):
        load_source("llama-9", "dummy", 0, CPU, torch.float32)


# --- the bundled tokenizer ----------------------------------------------------------------------

def test_bundled_tokenizer_matches_the_gguf(bundled: Tokenizer, smollm2_path: str) -> None:
    gguf_tok = load_tokenizer(smollm2_path)
    for text in TEXTS:
        ids = gguf_tok.encode(text)
        assert bundled.encode(text) == ids, text
        assert bundled.encode(text, add_special_tokens=False) == gguf_tok.encode(text, False)
        for skip in (True, False):
            assert bundled.decode(ids, skip) == gguf_tok.decode(ids, skip), text
        assert bundled.convert_ids_to_tokens(ids) == gguf_tok.convert_ids_to_tokens(ids)
    for messages in CHATS:
        for gen in (True, False):
            expected = gguf_tok.apply_chat_template(messages, gen)
            assert bundled.apply_chat_template(messages, gen) == expected
    facts = ("bos_token_id", "eos_token_id", "vocab_size", "all_special_ids", "chat_template")
    assert [getattr(bundled, f) for f in facts] == [getattr(gguf_tok, f) for f in facts]


def test_bundled_tokenizer_files() -> None:
    # Small enough to ship, and gzip's header carries no timestamp: re-exporting changes nothing.
    path = os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer.json.gz")
    assert os.path.getsize(path) < 1_000_000
    with open(path, "rb") as f:
        assert f.read(8)[4:8] == b"\0\0\0\0"  # mtime
    with gzip.open(path, "rt", encoding="utf-8") as f:
        assert json.load(f)["model"]["type"] == "BPE"


def test_preset_tokenizer_fits_the_vocabulary(bundled: Tokenizer) -> None:
    # llama-2-13b has 32000 ids: the bundled tokenizer's larger ids wrap, token counts stay.
    small = load_source_tokenizer("llama-2-13b")
    assert small.vocab_size == 32000 and small.all_special_ids == bundled.all_special_ids
    for text in TEXTS:
        ids, folded = bundled.encode(text), small.encode(text)
        assert len(folded) == len(ids) and max(folded, default=0) < 32000
        for i, f in zip(ids, folded):
            assert f == i if i < 32000 else f not in bundled.all_special_ids
    assert any(i >= 32000 for i in bundled.encode(TEXTS[2]))  # the wrap is exercised
    # The first id past the vocabulary wraps to the first one after the control tokens.
    assert small.encode(bundled.decode([32000])) == [max(bundled.all_special_ids) + 1]
    # llama-3-8b has more ids than the tokenizer: it is used as is.
    assert load_source_tokenizer("llama-3-8b").encode(TEXTS[2]) == bundled.encode(TEXTS[2])


# --- dummy weights ------------------------------------------------------------------------------

def test_dummy_weights_shapes_values_and_seed() -> None:
    config = tiny_config()
    weights = dummy_weights(config, 0, CPU, torch.bfloat16)
    shapes = expected_shapes(config)
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    assert all(v.dtype == torch.bfloat16 and v.device == CPU for v in weights.values())
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert torch.equal(weights[norm], torch.ones(64, dtype=torch.bfloat16))
    q = weights["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - INIT_STD) < 0.1 * INIT_STD and abs(q.mean().item()) < 0.01
    again = dummy_weights(config, 0, CPU, torch.bfloat16)
    assert all(torch.equal(weights[k], again[k]) for k in shapes)
    other = dummy_weights(config, 1, CPU, torch.bfloat16)
    assert not torch.equal(weights["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    tied = dummy_weights(tiny_config(tie_word_embeddings=True), 0, CPU, torch.float32)
    assert "lm_head.weight" not in tied and tied["model.norm.weight"].dtype == torch.float32


def test_preset_builds_with_dummy_weights_whatever_the_load_format() -> None:
    for load_format in ("auto", "dummy"):
        path, config, weights, tokenizer = load_source("tiny-llama", load_format, 0, CPU,
                                                       torch.float32)
        assert path == "tiny-llama" and config.vocab_size == tokenizer.vocab_size == 49152
        assert set(weights) == set(expected_shapes(config))


def test_preset_generates_deterministically_per_seed() -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = ["Hello world", "The printing press was"]

    def run(seed: int) -> list[tuple[list[int], Any]]:
        llm = _llm(seed=seed)
        outs = llm.generate(prompts, params)
        llm.engine.close()
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    first = run(0)
    assert run(0) == first  # same weights, same tokens, same logprobs
    assert run(1) != first


def test_ids_past_the_tokenizer_decode_to_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # A preset may have more ids than the bundled tokenizer (llama-3-8b: 128256 vs 49152); the
    # engine must sample them and stream their (empty) text without failing.
    wide = {**model_preset("tiny-llama"), "vocab_size": 80000}
    monkeypatch.setattr(source, "model_preset", lambda name: dict(wide))
    llm = _llm()
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate("Once upon a time", params)[0].outputs[0]
    llm.engine.close()
    past = [i for i in out.token_ids if i >= 49152]
    assert past and len(out.token_ids) == 24
    known = [i for i in out.token_ids if i < 49152]
    assert out.text == llm.get_tokenizer().decode(known)


# --- --load-format dummy on real checkpoints ----------------------------------------------------

def test_dummy_on_the_gguf_reads_no_tensor(
    monkeypatch: pytest.MonkeyPatch, smollm2_path: str
) -> None:
    def no_dequantize(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor was dequantized")

    monkeypatch.setattr(gguf.quants, "dequantize", no_dequantize)
    path, config, weights, tokenizer = load_source("smollm2-135m", "dummy", 0, CPU, torch.float32)
    assert path == smollm2_path
    assert config == config_from_hf(model_preset("smollm2-135m"))  # the preset is right
    assert set(weights) == set(expected_shapes(config))
    assert torch.equal(weights["model.norm.weight"], torch.ones(576))  # not the trained norms
    assert tokenizer.chat_template is not None and tokenizer.vocab_size == 49152


def test_default_model_generates_with_dummy_weights() -> None:
    llm = _llm(model="smollm2-135m", load_format="dummy", max_model_len=256)
    out = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    llm.engine.close()
    assert len(out.outputs[0].token_ids) == 3


def test_dummy_on_a_hf_folder_needs_only_its_config(tmp_path: Path, bundled: Tokenizer) -> None:
    config = {**model_preset("tiny-llama"), "model_type": "llama", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with gzip.open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer.json.gz")) as f:
        (tmp_path / "tokenizer.json").write_bytes(f.read())
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_source(str(tmp_path), "auto", 0, CPU, torch.float32)
    path, got, weights, tokenizer = load_source(str(tmp_path), "dummy", 0, CPU, torch.bfloat16)
    assert path == str(tmp_path) and got.tie_word_embeddings and "lm_head.weight" not in weights
    assert tokenizer.encode("héllo") == bundled.encode("héllo")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_source(str(tmp_path), "pt", 0, CPU, torch.float32)


# --- command line -------------------------------------------------------------------------------

def test_cli_generates_with_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from chunkserve.cli import main

    argv = ["generate", "--model", "tiny-llama", "--max-tokens", "4", "--prompt", "Hi",
            "--ignore-eos"]
    assert main(argv + ["--load-format", "dummy", "--seed", "1"]) == 0
    assert "4 generated" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-lama", "--prompt", "Hi"]) == 2
    assert "model preset (random weights)" in capsys.readouterr().err
