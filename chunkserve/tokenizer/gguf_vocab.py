"""Rebuilds a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores as metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: tokens, merges or scores,
token types and a pre-tokenizer name. Two kinds are rebuilt here, as llama.cpp (llama-vocab.cpp)
tokenizes them, since llama.cpp is what wrote the file and what chunkserve is compared with:

- "gpt2": byte-level BPE (SmolLM2, Llama 3, Qwen2/2.5/3, Mistral Nemo). The pre-tokenizer name
  matters as much as the merges: it decides where text is split before merging, and a wrong split
  silently changes token ids.
- "llama": SentencePiece BPE (Llama 2, Mistral 7B v0.1-v0.3, Phi-3, Gemma 3): pieces with scores,
  "▁" for a space, a space put before the text (unless add_space_prefix is false, as Gemma's
  files say), and <0xXX> byte tokens for what the pieces do not cover. Gemma's runs of spaces,
  tabs or newlines are user-defined tokens that llama.cpp's converter writes as real whitespace
  (not "▁"), so, like every user-defined token, they are cut out of the raw text before merging.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.gguf_file import gguf_field, open_gguf

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The split regexes as llama.cpp runs them. Its contractions are spelled (?:'[sS]|...) where the
# tokenizer.json files say (?i:'s|...): the same for ASCII, but Oniguruma's (?i) also folds "ſ"
# (U+017F) into "s", which llama.cpp does not, so the (?i) spelling would split "it'ſ" apart.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# Llama 3 (tiktoken style): digits in groups of up to 3, letters with one leading non-letter,
# punctuation runs, newlines kept apart from other whitespace.
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 (also Qwen2.5 and Qwen3): Llama 3's split, but every digit on its own.
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Mistral Nemo, Mistral Small): words split before an upper-case run, single
# digits, "/" kept with punctuation. tokenizer.json writes the letter classes as
# [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}]; llama.cpp approximates them with
# "a letter that is not a-z" / "... not A-Z" (so a non-ASCII letter counts as both cases and a
# combining mark as no letter), and that approximation is what it tokenizes with.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre names, as llama.cpp groups them (those of the Llama, Qwen, Mistral and Phi
# families; "pixtral" is Mistral's name for the Llama 3 split).
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "pixtral")
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen")
_TEKKEN_NAMES = ("tekken",)
# Pre-tokenizers for which llama.cpp takes a whole pre-token from the vocabulary before trying
# merges (ignore_merges), and adds BOS when the file does not say.
_WHOLE_WORD_FIRST = _LLAMA3_NAMES + _TEKKEN_NAMES

_SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space

# llama.cpp recognises a Phi-3 model by its name and lets its special tokens swallow the
# whitespace after them, as the rstrip flag of Phi-3's tokenizer.json does ("<|user|>\nHi" is
# <|user|> then "▁Hi"). These three keep the whitespace. (llama.cpp strips C isspace, ASCII
# only; an AddedToken's rstrip also takes Unicode spaces such as U+00A0.)
_PHI3_NAMES = ("phi-3", "phi3")
_PHI3_KEEP_WHITESPACE = ("<unk>", "<s>", "<|endoftext|>")


@dataclass
class GGUFTokenizerSpec:
    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # StarCoder-family vocabularies (SmolLM) were trained with every digit split off, then
        # GPT-2's regex; llama.cpp's "smollm" pre-tokenizer does the same.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _LLAMA3_NAMES:
        return _split(_LLAMA3_SPLIT)
    if pre in _QWEN2_NAMES:
        return _split(_QWEN2_SPLIT)
    if pre in _TEKKEN_NAMES:
        return _split(_TEKKEN_SPLIT)
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("GGUF pre-tokenizer %r is not known here; using GPT-2's split, "
                       "which may tokenize some text differently from llama.cpp.", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level_bpe(reader: Any, tokens: list[str], pre: str | None) -> HFTokenizer:
    merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges", [])
    vocab = {token: index for index, token in enumerate(tokens)}
    # Merge entries are "left right"; byte-level tokens never contain a real space.
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(
        vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
        # Llama 3 takes a whole pre-token from the vocabulary before trying merges; llama.cpp
        # does the same for that pre-tokenizer, and results can differ from merge-only BPE.
        ignore_merges=pre in _WHOLE_WORD_FIRST,
    )
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's (and llama.cpp's) merge-by-score.

    SentencePiece BPE keeps no merge list: it repeatedly joins the neighbouring pair whose joined
    text is the piece with the highest score. As ranked merges, every split of a piece into two
    pieces becomes a merge, ranked by the joined piece's score. Ties (equal scores) go to the
    longer left part, then to vocabulary order, as transformers' converter ranks them; llama.cpp
    takes the leftmost pair on a tie, which ranked merges cannot say, and only a word holding two
    different pairs of equal score can tell the two apart.
    """
    found: list[tuple[float, int, int, int, int, str, str]] = []
    for index, piece in enumerate(tokens):
        if vocab.get(piece) != index:
            continue  # a duplicate spelling: llama.cpp refuses the file; keep the first
        splits = sorted((vocab[piece[:cut]], vocab[piece[cut:]], cut)
                        for cut in range(1, len(piece))
                        if piece[:cut] in vocab and piece[cut:] in vocab)
        for order, (_, _, cut) in enumerate(splits):
            left, right = piece[:cut], piece[cut:]
            found.append((-scores[index], -len(left), -len(right), index, order, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(reader: Any, tokens: list[str], types: list[int],
                       add_space_prefix: bool) -> HFTokenizer:
    scores: list[float] | None = gguf_field(reader, "tokenizer.ggml.scores")
    has_scores = bool(scores)
    if not scores:
        scores = [0.0] * len(tokens)  # llama.cpp's score when the file has none
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    listed: list[str] | None = gguf_field(reader, "tokenizer.ggml.merges")
    if has_scores or not listed:
        # llama.cpp merges a SentencePiece vocabulary by score and never reads a merge list
        # (its converter writes none).
        merges = _merges_from_scores(tokens, scores, vocab)
    else:
        merges = [(left, right) for left, right in (m.split(" ", 1) for m in listed)]

    unk_id = gguf_field(reader, "tokenizer.ggml.unknown_token_id")
    if unk_id is None or not 0 <= unk_id < len(tokens):
        unk_id = next((i for i, k in enumerate(types) if k == _UNKNOWN), None)
    bpe = models.BPE(
        vocab=vocab, merges=merges,
        unk_token=None if unk_id is None else tokens[unk_id],
        # A character no piece covers becomes its UTF-8 bytes, as <0xXX> tokens.
        fuse_unk=True, byte_fallback=True,
    )
    tokenizer = HFTokenizer(bpe)
    # llama.cpp spells each space "▁" and, with add_space_prefix, puts one more before every run
    # of text that starts the input or follows a special token -- even when the text starts with
    # a space itself (" hi" is "▁▁hi", as SentencePiece makes it). A normalizer does exactly that:
    # it runs on each stretch of text between added tokens, and not on an empty one. (transformers'
    # GGUF loader uses a Metaspace pre-tokenizer for Llama and Mistral files instead, which adds
    # the "▁" only at the start of the input and not before text that starts with a space; its
    # Phi-3 path is the one that agrees with llama.cpp.)
    replace = normalizers.Replace(" ", _SPACE)
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPACE), replace])
                            if add_space_prefix else replace)
    # No pre-tokenizer: SentencePiece merges across word boundaries ("▁▁" is a piece).
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # Drop the space the encoder put in front, so decode(encode(text)) == text.
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _add_vocabulary_tokens(tokenizer: HFTokenizer, tokens: list[str], types: list[int],
                           model_name: str) -> None:
    """Control, unknown and user-defined tokens are matched whole in the raw text before anything
    else (llama.cpp's tokenizer_st_partition with parse_special, as llama-server tokenizes a
    prompt). Control and unknown ones count as special: skipped when decoding without specials."""
    phi3 = any(name in model_name.lower() for name in _PHI3_NAMES)

    def rstrip(token: str) -> bool:
        return phi3 and token not in _PHI3_KEEP_WHITESPACE

    special = [AddedToken(t, special=True, normalized=False, rstrip=rstrip(t))
               for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False, rstrip=rstrip(t))
            for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _token_id(reader: Any, key: str, default: int | None, size: int) -> int | None:
    value = gguf_field(reader, key, default)
    if value is None or not 0 <= value < size:
        # llama.cpp ignores an id outside the vocabulary (it logs and keeps its default).
        return default if default is not None and 0 <= default < size else None
    return int(value)


def load_gguf_tokenizer(path: str) -> GGUFTokenizerSpec:
    reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2': SmolLM2, Llama 3, Qwen...) and SentencePiece BPE ('llama': Llama 2, "
            "Mistral 7B, Phi-3, Gemma 3) can be rebuilt from a GGUF."
        )
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)

    if kind == "gpt2":
        tokenizer = _byte_level_bpe(reader, tokens, pre)
        # llama.cpp's defaults when the file does not say: BOS for the Llama 3 and Tekken splits.
        default_bos, default_eos, add_bos = None, None, pre in _WHOLE_WORD_FIRST
    else:
        add_space_prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
        tokenizer = _sentencepiece_bpe(reader, tokens, types, add_space_prefix)
        # llama.cpp's SentencePiece defaults: <s> = 1, </s> = 2, and BOS added.
        default_bos, default_eos, add_bos = 1, 2, True
    _add_vocabulary_tokens(tokenizer, tokens, types, gguf_field(reader, "general.name") or "")

    return GGUFTokenizerSpec(
        tokenizer=tokenizer,
        bos_token_id=_token_id(reader, "tokenizer.ggml.bos_token_id", default_bos, len(tokens)),
        eos_token_id=_token_id(reader, "tokenizer.ggml.eos_token_id", default_eos, len(tokens)),
        # The file's flag wins (SmolLM2 says False; Llama 2, Mistral and Phi-3 files say True).
        add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", add_bos)),
        add_eos=bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )
