"""GGUF vocabularies beyond SmolLM2's: the Qwen2 (and Tekken) splits of byte-level BPE, and
SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral 7B, Phi-3, and Gemma
3's shape; the real Gemma 3 file is checked in tests/test_gemma3_gguf.py).

Every file is written here with gguf's GGUFWriter (metadata only) and read back by chunkserve's
Tokenizer.from_gguf. References: transformers' own GGUF tokenizer loader, SentencePiece itself
(a small BPE model trained in the test, dumped to GGUF the way llama.cpp's convert_hf_to_gguf.py
does), and a transcription of llama.cpp's SentencePiece tokenizer (llama-vocab.cpp), which is
what the GGUF files are made for and where transformers differs.
"""
from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import gguf
import pytest
import sentencepiece

from chunkserve.gguf_file import gguf_field, open_gguf
from chunkserve.model.loaders.source import resolve_model_path
from chunkserve.tokenizer.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _write_gguf(path: Path, arch: str, model: str, tokens: list[str], types: list[int], *,
                pre: str = "default", scores: list[float] | None = None,
                merges: list[str] | None = None, name: str | None = None,
                bos: int | None = None, eos: int | None = None, unk: int | None = None,
                add_bos: bool | None = None, add_eos: bool | None = None,
                add_space_prefix: bool | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    for value, add in ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id),
                       (unk, writer.add_unk_token_id), (add_bos, writer.add_add_bos_token),
                       (add_eos, writer.add_add_eos_token),
                       (add_space_prefix, writer.add_add_space_prefix)):
        if value is not None:
            add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference(folder: Path, name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


def _assert_same(ours: Tokenizer, ref: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == ref.encode(text), text
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


# --- SentencePiece ("llama") vocabularies ---------------------------------------------------------

_WORDS = """the of and to in is was for on that with as by at from his her it an were are which be
or has had not but one all their they been new more who also after first two would other when time
there she can into its over only year world city people state music called school film made most
series some where between used known three many later may united such national being about these
under while then both through war group number part since however house game river life back team
season well town water book show light green small large great little long what
naïve café résumé über straße señor façade jalapeño Zürich Gödel Ångström
Hello Paris London Python Linux model token server request prompt batch chunk cache""".split()

# Mistral v0.3 keeps its [INST] markers as SentencePiece control pieces; Phi-3 adds its chat
# markers after the SentencePiece vocabulary (tokenizer_config's added_tokens_decoder: special
# ones become CONTROL, others USER_DEFINED, each with score -1000, as llama.cpp's converter does).
_SPM_CONTROL = ["[INST]", "[/INST]"]
_ADDED = [("<|endoftext|>", CONTROL), ("<|assistant|>", CONTROL), ("<|end|>", CONTROL),
          ("<|user|>", CONTROL), ("<tool_call>", USER_DEFINED)]

SPM_TEXTS = [
    "Hello world",
    "the city of music",
    "12345",
    "Zürich 3.14159, naïve café",
    "emoji 🚀 and 日本語 need byte fallback",
    "a\nb\n\n\tc",
    "multiple    spaces   inside",
    " one leading space",
    "   three leading",
    "trailing  ",
    "[INST] What is the river? [/INST] A river.</s>",
    "<s>twice",
    "<|user|>\nHi there<|end|>\n<|assistant|>\n",
    'call <tool_call>{"x": 1}',
    "<unk> literal",
    "",
    " ",
    "\n",
]


class SpmVocab:
    def __init__(self, sp: Any, tokens: list[str], scores: list[float], types: list[int]) -> None:
        self.sp, self.tokens, self.scores, self.types = sp, tokens, scores, types
        self.ids = {t: i for i, t in enumerate(tokens)}
        # What llama.cpp cuts out of the text before tokenizing (cache_special_tokens).
        self.specials = [t for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED, UNKNOWN)]

    def write(self, path: Path, arch: str = "llama", **kwargs: Any) -> None:
        kwargs = {"name": "toy-spm", "bos": 1, "eos": 2, "unk": 0, "add_bos": True,
                  "add_eos": False, **kwargs}
        _write_gguf(path, arch, "llama", self.tokens, self.types, scores=self.scores, **kwargs)

    def plain(self, text: str) -> bool:
        return not any(s in text for s in self.specials)

    # llama.cpp's SentencePiece path, transcribed from llama-vocab.cpp -----------------------------

    def merge(self, text: str) -> list[int]:
        """llm_tokenizer_spm_session: join the neighbouring pair whose text is the highest-scoring
        vocabulary entry (the leftmost on a tie) until none is left; what is not a vocabulary entry
        then is a single character, written as its UTF-8 bytes (<0xXX> tokens)."""
        symbols = list(text)
        while True:
            best: tuple[float, int] | None = None
            for i in range(len(symbols) - 1):
                index = self.ids.get(symbols[i] + symbols[i + 1])
                if index is not None and (best is None or self.scores[index] > best[0]):
                    best = (self.scores[index], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        out: list[int] = []
        for symbol in symbols:
            if symbol in self.ids:
                out.append(self.ids[symbol])
            else:
                out.extend(self.ids[f"<0x{b:02X}>"] for b in symbol.encode("utf-8"))
        return out

    def llama_cpp(self, text: str, *, add_bos: bool = True, add_space_prefix: bool = True,
                  rstrip: frozenset[str] = frozenset()) -> list[int]:
        """llama_vocab::impl::tokenize (SPM, parse_special): special tokens, longest first, are cut
        out of the raw text (those in `rstrip` eat the whitespace after them); each remaining run
        of text gets a space in front when it starts the input or follows a special token."""
        fragments: list[str | int] = [text] if text else []
        for special in sorted(self.specials, key=len, reverse=True):
            cut: list[str | int] = []
            for fragment in fragments:
                if not isinstance(fragment, str):
                    cut.append(fragment)
                    continue
                for n, part in enumerate(fragment.split(special)):
                    if n:
                        cut.append(self.ids[special])
                        if special in rstrip:
                            part = part.lstrip(" \t\n\v\f\r")  # C isspace
                    if part:
                        cut.append(part)
            fragments = cut
        ids = [1] if add_bos else []
        prev_special = True
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
                prev_special = True
                continue
            run = (" " if add_space_prefix and prev_special else "") + fragment
            ids += self.merge(run.replace(" ", "\u2581"))
            prev_special = False
        return ids


@pytest.fixture(scope="module")
def spm() -> SpmVocab:
    rng = random.Random(0)
    lines = []
    for _ in range(400):
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 99999)}"
        if rng.random() < 0.2:
            line = line.capitalize() + "."
        if rng.random() < 0.1:
            line = "    " + line
        lines.append(line)
    model = io.BytesIO()
    # Llama 2's settings: BPE, byte fallback, no normalization, a dummy prefix, spaces kept as
    # they are (runs of "▁" are pieces), digits split, <unk> <s> </s> = 0 1 2.
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=700,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=_SPM_CONTROL, minloglevel=2,
    )
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    # llama.cpp's _create_vocab_sentencepiece: piece, score and type for every id.
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i)
                else UNUSED if sp.is_unused(i) else BYTE if sp.is_byte(i) else NORMAL)
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(kind)
    for token, kind in _ADDED:
        tokens.append(token)
        scores.append(-1000.0)
        types.append(kind)
    vocab = SpmVocab(sp, tokens, scores, types)
    assert {BYTE, CONTROL, UNKNOWN, USER_DEFINED} <= set(types) and "\u2581\u2581" in vocab.ids
    return vocab


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_spm_follows_llama_cpp(spm: SpmVocab, tmp_path: Path, add_space_prefix: bool) -> None:
    path = tmp_path / "spm.gguf"
    spm.write(path, add_space_prefix=add_space_prefix)
    ours = Tokenizer.from_gguf(str(path))
    rng = random.Random(1)
    alphabet = "abcdefghij ABC 0123 .,'\n\téü日🚀"
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in SPM_TEXTS + fuzz:
        expected = spm.llama_cpp(text, add_space_prefix=add_space_prefix)
        assert ours.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == expected[1:]
        if spm.plain(text):
            assert ours.decode(expected) == text  # spaces and byte-fallback tokens come back


def test_spm_matches_sentencepiece(spm: SpmVocab, tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    spm.write(path)
    ours = Tokenizer.from_gguf(str(path))
    rng = random.Random(2)
    chars = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ 0123456789 .,;'\"\n\t éüöñß 日本 🚀👍🏽"
    fuzz = ["".join(rng.choice(chars) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    fuzz += [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in [t for t in SPM_TEXTS if spm.plain(t)] + fuzz:
        # SentencePiece puts its dummy prefix before the whole text, as llama.cpp does when no
        # special token is in it; text without one is where the two can be compared.
        expected = spm.sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.encode(text) == [1, *expected]
        assert ours.decode([1, *expected]) == spm.sp.decode(expected) == text


def test_spm_matches_transformers(spm: SpmVocab, tmp_path: Path) -> None:
    # transformers' GGUF loader builds a SentencePiece vocabulary two ways. For architecture
    # "phi3" it spells a space "▁" and prepends one with a normalizer, which runs on each stretch
    # of text between special tokens -- llama.cpp's rule -- so every text must agree, special
    # tokens, leading spaces and all.
    spm.write(tmp_path / "phi3.gguf", "phi3")
    ours = Tokenizer.from_gguf(str(tmp_path / "phi3.gguf"))
    ref = _reference(tmp_path, "phi3.gguf")
    for text in SPM_TEXTS:
        _assert_same(ours, ref, text)
    assert ours.vocab_size == len(ref) == len(spm.tokens)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)

    # For Llama and Mistral files it uses a Metaspace pre-tokenizer that adds the "▁" only at
    # the very start and not before text that already starts with a space: " hi" is ▁hi there,
    # ▁▁hi in llama.cpp and SentencePiece, and "[INST] hi" is [INST] ▁hi there, [INST] ▁▁hi in
    # llama.cpp. A GGUF's tokenizer is llama.cpp's, so chunkserve follows llama.cpp (checked in
    # the tests above) and agrees with this path only on text without either.
    spm.write(tmp_path / "llama.gguf", "llama")
    ours = Tokenizer.from_gguf(str(tmp_path / "llama.gguf"))
    ref = _reference(tmp_path, "llama.gguf")
    agreeing = [t for t in SPM_TEXTS if spm.plain(t) and not t[:1].isspace()]
    assert len(agreeing) >= 8
    for text in agreeing:
        _assert_same(ours, ref, text)
    assert ours.encode(" hi") == spm.llama_cpp(" hi") != ref.encode(" hi")


def test_spm_phi3_special_tokens_eat_following_whitespace(spm: SpmVocab, tmp_path: Path) -> None:
    # llama.cpp recognises Phi-3 by general.name and gives its special tokens rstrip (as Phi-3's
    # tokenizer.json does), except <unk>, <s> and <|endoftext|>.
    path = tmp_path / "phi3.gguf"
    spm.write(path, "phi3", name="Phi-3-mini-4k-instruct")
    ours = Tokenizer.from_gguf(str(path))
    rstrip = frozenset(spm.specials) - {"<unk>", "<s>", "<|endoftext|>"}
    for text in SPM_TEXTS + ["<|endoftext|> x", "<s>  y", "<|end|>  \n\t z"]:
        assert ours.encode(text) == spm.llama_cpp(text, rstrip=rstrip), text
    chat = ours.encode("<|user|>\nthe<|end|>\n<|assistant|>\n", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(chat) == ["<|user|>", "\u2581the", "<|end|>", "<|assistant|>"]


# Gemma's converter output: whitespace runs and newlines are user-defined tokens spelled with real
# whitespace (its "▁" put back to " "), turn markers are control tokens, and no "▁" goes before
# the text (add_space_prefix false).
_GEMMA_ADDED = [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED),
                ("\n\n", USER_DEFINED), ("  ", USER_DEFINED), ("   ", USER_DEFINED),
                ("    ", USER_DEFINED), ("\t\t", USER_DEFINED)]


def test_spm_gemma_shape_follows_llama_cpp(spm: SpmVocab, tmp_path: Path) -> None:
    gemma = SpmVocab(spm.sp, spm.tokens + [t for t, _ in _GEMMA_ADDED],
                     spm.scores + [-1000.0] * len(_GEMMA_ADDED),
                     spm.types + [k for _, k in _GEMMA_ADDED])
    path = tmp_path / "gemma.gguf"
    gemma.write(path, "gemma3", name="Gemma 3 toy", add_space_prefix=False)
    ours = Tokenizer.from_gguf(str(path))
    rng = random.Random(3)
    alphabet = ["the", "city", " ", "  ", "\n", "\t", "é", "日", "🚀", "7", "<end_of_turn>"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(200)]
    texts = SPM_TEXTS + fuzz + ["<start_of_turn>user\nHi<end_of_turn>\n", "x    \n\n\ny"]
    for text in texts:
        expected = gemma.llama_cpp(text, add_space_prefix=False)
        assert ours.encode(text) == expected, text
        if gemma.plain(text.replace(" ", "").replace("\n", "").replace("\t", "")):
            assert ours.decode(expected) == text  # no prefix space to strip, nothing lost
    ids = ours.encode("x  y", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids) == ["x", "  ", "y"]  # two spaces: one added token


def test_spm_special_token_facts(spm: SpmVocab, tmp_path: Path) -> None:
    # No add_bos/add_eos flags and no BOS/EOS ids: llama.cpp's SentencePiece defaults, <s> = 1
    # added in front, </s> = 2 not added.
    path = tmp_path / "bare.gguf"
    spm.write(path, bos=None, eos=None, unk=None, add_bos=None, add_eos=None)
    tok = Tokenizer.from_gguf(str(path))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("Hello") == [1, *spm.sp.encode("Hello")]
    assert {0, 1, 2, spm.ids["[INST]"], spm.ids["<|end|>"]} <= set(tok.all_special_ids)
    assert spm.ids["<tool_call>"] not in tok.all_special_ids  # user-defined: plain added text
    ids = tok.encode("[INST] Hello [/INST]")
    assert tok.decode(ids) == " Hello "  # control tokens skipped, the spaces around them kept
    assert tok.decode(ids, skip_special_tokens=False) == "<s>[INST]  Hello [/INST]"

    path = tmp_path / "flags.gguf"
    spm.write(path, add_bos=False, add_eos=True)
    tok = Tokenizer.from_gguf(str(path))
    assert tok.encode("Hello") == [*spm.sp.encode("Hello"), 2]
    assert tok.encode("Hello", add_special_tokens=False) == spm.sp.encode("Hello")


def test_unsupported_tokenizer_models_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t5.gguf"
    _write_gguf(path, "t5", "t5", ["<pad>", "</s>", "<unk>", "\u2581a"], [3, 3, 2, 1],
                scores=[0.0, 0.0, 0.0, -1.0])
    with pytest.raises(ValueError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf(str(path))


# --- byte-level BPE: the Qwen2 and Tekken splits ------------------------------------------------

BPE_TEXTS = [
    "Hello world",
    "12345 and 1234567",
    "a 12 b, 3.14159 and 2,000,000",
    "multiple    spaces  here",
    "a\nb\n\n\nc\r\nd  \n",
    " leading space",
    "it's we're I'll DON'T",
    "getHTTPResponse ABCdef x/y/z",
    "path/to/file.py\n\tx = 1",
    "<|im_start|>user\nhi<|im_end|>\n",
    "naïve café — 日本語 🚀👍🏽",
    "",
]


@pytest.fixture(scope="module")
def byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """The first 4096 entries of the default model's (SmolLM2) vocabulary with the merges among
    them, plus "12" and "123": SmolLM2 learned every digit alone, so without a multi-digit token
    no split could show how it cuts digits."""
    reader = open_gguf(resolve_model_path("smollm2-135m"))
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")[:4096]
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type")[:4096]
    known = set(tokens)
    merges = [m for m in gguf_field(reader, "tokenizer.ggml.merges")
              if {*m.split(" "), m.replace(" ", "")} <= known]
    assert len(merges) > 3500 and CONTROL in types
    return tokens + ["12", "123"], merges + ["1 2", "12 3"], types + [NORMAL, NORMAL]


@pytest.mark.parametrize("pre", ["qwen2", "tekken"])
def test_byte_level_splits_match_transformers(
    byte_vocab: tuple[list[str], list[str], list[int]], tmp_path: Path, pre: str
) -> None:
    tokens, merges, types = byte_vocab
    _write_gguf(tmp_path / "bpe.gguf", pre.replace("tekken", "llama"), "gpt2", tokens, types,
                pre=pre, merges=merges, bos=1, eos=2, add_bos=False)
    ours = Tokenizer.from_gguf(str(tmp_path / "bpe.gguf"))
    ref = _reference(tmp_path, "bpe.gguf")
    # transformers knows both names (integrations/gguf GGUF_PRE_TOKENIZER_SPLITS): the split is
    # its own statement of Qwen's and Mistral's regexes, not ours.
    assert "Split" in repr(ref.backend_tokenizer.pre_tokenizer)
    texts = BPE_TEXTS
    if pre == "tekken":
        # llama.cpp approximates Tekken's upper/lower-case letter classes with [^a-z]/[^A-Z]
        # (a non-ASCII letter counts as both), and so does chunkserve; transformers keeps the
        # Unicode classes. ASCII text is split the same either way.
        texts = [t for t in BPE_TEXTS if t.isascii()]
    for text in texts:
        _assert_same(ours, ref, text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    digits = ours.convert_ids_to_tokens(ours.encode("x 12345"))
    assert digits == ["x", "Ġ", "1", "2", "3", "4", "5"]  # one digit at a time, "123" unused


def test_byte_level_bos_defaults(tmp_path: Path) -> None:
    # Without an add_bos_token flag llama.cpp adds BOS for the Llama 3 and Tekken splits only.
    tokens = ["a", "b", "ab", "<s>"]
    for pre, add in (("llama-bpe", True), ("tekken", True), ("qwen2", False), ("smollm", False)):
        path = tmp_path / f"{pre}.gguf"
        _write_gguf(path, "llama", "gpt2", tokens, [1, 1, 1, 3], pre=pre, merges=["a b"], bos=3)
        assert Tokenizer.from_gguf(str(path)).encode("ab") == ([3, 2] if add else [2]), pre
