"""Our tokenizer, rebuilt from GGUF metadata, against transformers' tokenizers for the same files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import gguf
import pytest

from chunkserve.model.loaders.source import resolve_model_path
from chunkserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "12345",
    "a 12 b, 3.14159 and 2,000,000",
    "héllo wörld — naïve café",
    "日本語のテキスト",
    "emoji 🚀🔥👍🏽 done",
    "def f(x):\n    return x + 1\n\n\n\tpass  # comment",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>x<repo_name>",
    "  leading and trailing   ",
    "a\r\nb",
    "ĠĠ literal byte-level characters",
    "it's we're I'll DON'T",
    "",
]
# Whitespace right before a digit: the only place our SmolLM2 tokenizer differs from
# transformers' GGUF one (see test_smollm_pre_tokenizer_splits_digits_first).
DIGIT_AFTER_SPACES = ["x  1", "  42", "\t7\n\n 8", "   \n   99 bottles"]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🙂"}],
]


@pytest.fixture(scope="module")
def smol_path() -> str:
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def ours(smol_path: str) -> Tokenizer:
    return load_tokenizer(smol_path)


@pytest.fixture(scope="module")
def ref(smollm2_hf_tokenizer: Any) -> Any:
    return smollm2_hf_tokenizer  # transformers' tokenizer for the same file (conftest)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, ref: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text == ref.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_smollm_pre_tokenizer_splits_digits_first(ours: Tokenizer, ref: Any) -> None:
    # SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split off every
    # digit before GPT-2's regex. transformers' GGUF converter ignores that pre-tokenizer name and
    # uses GPT-2's regex alone, which only shows when whitespace precedes a digit: "x  1" is
    # x|ĠĠ|1 for the model but x|Ġ|Ġ|1 there. So compare with transformers' tokenizer given the
    # pre-tokenizer SmolLM2 ships with.
    from tokenizers import pre_tokenizers

    assert ours.convert_ids_to_tokens(ours.encode("x  1")) == ["x", "ĠĠ", "1"]
    assert ref.convert_ids_to_tokens(ref.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]
    original = ref.backend_tokenizer.pre_tokenizer  # put back after: the session shares `ref`
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    try:
        for text in TEXTS + DIGIT_AFTER_SPACES:
            assert ours.encode(text) == ref.encode(text), text
            assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    finally:
        ref.backend_tokenizer.pre_tokenizer = original


def test_special_tokens_and_ids(ours: Tokenizer, ref: Any) -> None:
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert ours.vocab_size == len(ref) == 49152
    assert {0, 1, 2} <= set(ours.all_special_ids)  # plus the other control tokens (<repo_name>...)
    # SmolLM2 says add_bos_token=False: no BOS even with special tokens on.
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False) == ref.encode("hi")
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == "user\nhi" == ref.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(
    ours: Tokenizer, ref: Any, messages: list[dict[str, Any]]
) -> None:
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False)
    assert expected.endswith("<|im_start|>assistant\n")


def test_hf_dir_tokenizer(ours: Tokenizer, ref: Any, tmp_path: Path) -> None:
    ref.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    hf = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert hf.encode(text) == ref.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert hf.apply_chat_template(CHATS[1]) == ours.apply_chat_template(CHATS[1])


def _write_tokenizer_gguf(path: Path, model: str, pre: str, tokens: list[str], merges: list[str],
                          types: list[int], template: str | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama3_pre_tokenizer_against_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # A toy Llama-3-style vocabulary: the 256 byte symbols, a few merges, one control token.
    alphabet = list(bytes_to_unicode().values())
    # "3 4" outranks the rest: GPT-2's split merges "1234" as 12|34, Llama 3's as 123|4.
    merges = ["3 4", "Ġ t", "h e", "Ġt he", "1 2", "12 3", "Ġ Ġ", "ĠĠ ĠĠ", "i n", "Ġ in"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|begin_of_text|>"]
    types = [1] * (len(tokens) - 1) + [3]
    path = tmp_path / "toy.gguf"
    _write_tokenizer_gguf(path, "gpt2", "llama-bpe", tokens, merges, types)

    ours = load_tokenizer(str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="toy.gguf")
    bos = len(tokens) - 1
    for text in ["the theme in the inn", "123456 1234", "    indent\n\n  x", "it's HE'LL", "日本 🚀"]:
        ids = ours.encode(text)
        assert ids[0] == bos  # this file asks for BOS
        assert ids[1:] == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert ours.encode("<|begin_of_text|>", add_special_tokens=False) == [bos]


def test_unsupported_tokenizer_and_missing_template(tmp_path: Path) -> None:
    # SentencePiece ("llama") vocabularies load now (test_gguf_tokenizers.py); T5's do not.
    path = tmp_path / "t5.gguf"
    _write_tokenizer_gguf(path, "t5", "default", ["<pad>", "</s>", "<unk>"], [], [3, 3, 2])
    with pytest.raises(ValueError, match="tokenizer model 't5' is not supported"):
        load_tokenizer(str(path))

    path = tmp_path / "bpe.gguf"
    _write_tokenizer_gguf(path, "gpt2", "default", ["a", "b", "ab", "<s>"], ["a b"], [1, 1, 1, 3])
    tok = load_tokenizer(str(path))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}"
                "{{ raise_exception('bad role') }}{% endif %}{{ m | tojson }}{% endfor %}")
    path = tmp_path / "t.gguf"
    _write_tokenizer_gguf(path, "gpt2", "default", ["a", "b", "ab", "<s>"], ["a b"], [1, 1, 1, 3], template)
    tok = load_tokenizer(str(path))
    rendered = tok.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert rendered == '<s>{"role": "user", "content": "<é>"}'  # no HTML escaping, no \\u00e9
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
