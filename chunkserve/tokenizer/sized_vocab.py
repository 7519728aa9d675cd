"""The bundled tokenizer (SmolLM2's byte-level BPE, 49,152 ids) resized to a model's vocabulary,
for files written with random weights (model/writers/): a Llama 3 shape has 128,256 ids, a
Mistral 7B shape 32,000. Peers check that the tokenizer and the embedding agree (llama.cpp
refuses a file whose token list is not the embedding's height), so the file's tokenizer must
have exactly the model's ids.

- Larger: the ids past the tokenizer's are "<|pad_N|>" tokens that no text encodes to (a
  vocabulary entry without a merge that makes it) and that decode to themselves.
- Smaller: ids at or past the size are dropped, with every merge that makes or uses one: text
  still encodes (the byte tokens come first), into more, shorter tokens.

Both forms are written from one plan: a tokenizer.json for HF folders, and llama.cpp's
`tokenizer.ggml.*` fields for GGUF files.
"""
from __future__ import annotations

import copy
import gzip
import json
import os
from dataclasses import dataclass
from typing import Any

from chunkserve.tokenizer.tokenizer import BUNDLED_TOKENIZER_DIR

# llama.cpp token types (llama_token_type), as tokenizer/gguf_vocab.py reads them.
NORMAL, CONTROL, UNUSED = 1, 3, 5
# What llama.cpp calls the bundled tokenizer's split (tokenizer.ggml.pre of SmolLM2's GGUF).
PRE_TOKENIZER = "smollm"


def pad_token(token_id: int) -> str:
    return f"<|pad_{token_id}|>"


@dataclass(frozen=True)
class SizedVocab:
    tokenizer_json: dict[str, Any]  # a whole tokenizer.json
    tokenizer_config: dict[str, Any]  # tokenizer_config.json
    tokens: list[str]  # by id, exactly vocab_size of them
    token_types: list[int]
    merges: list[str]  # "left right", llama.cpp's spelling
    bos_token_id: int
    eos_token_id: int

    def gguf_fields(self) -> dict[str, Any]:
        """llama.cpp's tokenizer keys (without the `tokenizer.` prefix's writer calls)."""
        return {"model": "gpt2", "pre": PRE_TOKENIZER, "tokens": self.tokens,
                "token_type": self.token_types, "merges": self.merges,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "add_bos_token": bool(self.tokenizer_config.get("add_bos_token", False)),
                "chat_template": self.tokenizer_config.get("chat_template")}


def _bundled() -> tuple[dict[str, Any], dict[str, Any]]:
    with gzip.open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer.json.gz"), "rt",
                   encoding="utf-8") as f:
        tokenizer_json = json.load(f)
    with open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        return tokenizer_json, json.load(f)


def sized_vocab(vocab_size: int) -> SizedVocab:
    """The bundled tokenizer with exactly `vocab_size` ids."""
    tokenizer_json, config = _bundled()
    model = tokenizer_json["model"]
    vocab: dict[str, int] = model["vocab"]
    specials = {a["id"]: a["content"] for a in tokenizer_json["added_tokens"] if a["special"]}
    bos, eos = (vocab[config["bos_token"]], vocab[config["eos_token"]])
    # Below the byte tokens no text could be encoded; below bos/eos the chat template breaks.
    floor = 1 + max(max(vocab[chr(c)] for c in range(0x21, 0x7F)), bos, eos)
    if vocab_size < floor:
        raise ValueError(f"a vocabulary of {vocab_size} ids is too small for the bundled "
                         f"tokenizer (it needs at least {floor})")
    out = copy.deepcopy(tokenizer_json)
    kept = {token: i for token, i in vocab.items() if i < vocab_size}
    kept.update({pad_token(i): i for i in range(len(vocab), vocab_size)})
    pairs = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    merges = [p for p in pairs if p[0] in kept and p[1] in kept and p[0] + p[1] in kept]
    out["model"]["vocab"], out["model"]["merges"] = kept, merges
    out["added_tokens"] = [a for a in tokenizer_json["added_tokens"] if a["id"] < vocab_size]
    tokens = sorted(kept, key=kept.__getitem__)
    types = [CONTROL if i in specials else UNUSED if i >= len(vocab) else NORMAL
             for i in range(vocab_size)]
    return SizedVocab(tokenizer_json=out, tokenizer_config=config, tokens=tokens,
                      token_types=types, merges=[" ".join(p) for p in merges],
                      bos_token_id=bos, eos_token_id=eos)
