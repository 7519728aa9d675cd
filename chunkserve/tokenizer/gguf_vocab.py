"""Rebuilds a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores as metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: tokens, merges, token
types and a pre-tokenizer name. The name matters as much as the merges: it decides where text is
split before merging, and a wrong split silently changes token ids.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.gguf_file import gguf_field, open_gguf

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type): 3 = control (<|im_start|>), 4 = user-defined.
_CONTROL = 3
_USER_DEFINED = 4

# The Llama-3 (tiktoken-style) split: digits in groups of up to 3, letters with one leading
# non-letter, punctuation runs, newlines kept apart from other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")


@dataclass
class GGUFTokenizerSpec:
    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # StarCoder-family vocabularies (SmolLM) were trained with every digit split off, then
        # GPT-2's regex; llama.cpp's "smollm" pre-tokenizer does the same.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _LLAMA3_NAMES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in (None, "default", "gpt2"):
        logger.warning("GGUF pre-tokenizer %r is not known here; using GPT-2's split, "
                       "which may tokenize some text differently from llama.cpp.", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def load_gguf_tokenizer(path: str) -> GGUFTokenizerSpec:
    reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2', used by SmolLM2, Llama 3, Qwen...) can be rebuilt from a GGUF."
        )
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges", [])
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", [])

    vocab = {token: index for index, token in enumerate(tokens)}
    # Merge entries are "left right"; byte-level tokens never contain a real space.
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(
        vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
        # Llama 3 takes a whole pre-token from the vocabulary before trying merges; llama.cpp
        # does the same for that pre-tokenizer, and results can differ from merge-only BPE.
        ignore_merges=pre in _LLAMA3_NAMES,
    )
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole in the raw text (as llama.cpp does)
    # instead of being byte-split; only control tokens count as special (skipped on decode).
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)

    return GGUFTokenizerSpec(
        tokenizer=tokenizer,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        # Byte-level BPE models add no BOS unless the file says so (SmolLM2 says False).
        add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )
