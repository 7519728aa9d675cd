"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the model-level facts around it
(BOS/EOS ids, whether BOS is prepended, the chat template), from a GGUF file or a HF folder."""
from __future__ import annotations

import copy
import gzip
import json
import os
from typing import Any, overload

import msgspec
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.tokenizer.chat_template import render_chat_template
from chunkserve.tokenizer.gguf_vocab import load_gguf_tokenizer
from chunkserve.presets import DATA_DIR

BUNDLED_TOKENIZER_DIR = os.path.join(DATA_DIR, "tokenizer")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _pick_template(value: Any) -> str | None:
    # Some configs hold several named templates ("default", "tool_use", ...); chat uses "default".
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value}
        return named.get("default")
    return value


class TokenizerSpec(msgspec.Struct, frozen=True):
    """A tokenizer as data (its tokenizer.json and the facts around it): how an engine of
    another process hands the API server its tokenizer without pickling an object."""

    tokenizer_json: str
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    vocab_limit: int | None
    fold_base: int


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos: bool, add_eos: bool = False, chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self._bos_id = bos_token_id
        self._eos_id = eos_token_id
        self._add_bos = add_bos and bos_token_id is not None
        self._add_eos = add_eos and eos_token_id is not None
        self._chat_template = chat_template
        self._vocab_limit: int | None = None  # see fold_to_vocab
        self._fold_base = 0

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        spec = load_gguf_tokenizer(path)
        return cls(spec.tokenizer, bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
                   add_bos=spec.add_bos, add_eos=spec.add_eos, chat_template=spec.chat_template)

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(
                f"{path}: no tokenizer.json (slow/sentencepiece-only tokenizers are not supported)."
            )
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        # Newer transformers save the template as its own file rather than inside the config.
        template_file = os.path.join(path, "chat_template.jinja")
        if _pick_template(config.get("chat_template")) is None and os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                config = {**config, "chat_template": f.read()}
        return cls._from_hf_config(HFTokenizer.from_file(tok_file), config)

    @classmethod
    def from_bundled(cls) -> Tokenizer:
        """SmolLM2's tokenizer, shipped in chunkserve/data/tokenizer for models that have none
        (presets with random weights); exported by tools/export_tokenizer.py."""
        with gzip.open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer.json.gz"), "rt",
                       encoding="utf-8") as f:
            tokenizer = HFTokenizer.from_str(f.read())
        config_file = os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer_config.json")
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
        return cls._from_hf_config(tokenizer, config)

    @classmethod
    def _from_hf_config(cls, tokenizer: HFTokenizer, config: dict[str, Any]) -> Tokenizer:
        """A tokenizer.json's tokenizer plus its tokenizer_config.json facts."""

        def token_id(key: str) -> int | None:
            text = _token_text(config.get(key))
            return None if text is None else tokenizer.token_to_id(text)

        bos_id = token_id("bos_token")
        # tokenizer.json's post-processor usually inserts BOS already (Llama 3 does); only add it
        # ourselves when the config asks for it and the post-processor does not do it.
        with_special = tokenizer.encode("a", add_special_tokens=True).ids
        post_adds_bos = bos_id is not None and bos_id in with_special
        return cls(tokenizer, bos_token_id=bos_id, eos_token_id=token_id("eos_token"),
                   add_bos=bool(config.get("add_bos_token", False)) and not post_adds_bos,
                   add_eos=False, chat_template=_pick_template(config.get("chat_template")))

    def spec(self) -> TokenizerSpec:
        return TokenizerSpec(self._tok.to_str(), self._bos_id, self._eos_id, self._add_bos,
                             self._add_eos, self._chat_template, self._vocab_limit,
                             self._fold_base)

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> Tokenizer:
        tok = cls(HFTokenizer.from_str(spec.tokenizer_json), bos_token_id=spec.bos_token_id,
                  eos_token_id=spec.eos_token_id, add_bos=spec.add_bos, add_eos=spec.add_eos,
                  chat_template=spec.chat_template)
        tok._vocab_limit, tok._fold_base = spec.vocab_limit, spec.fold_base
        return tok

    def fold_to_vocab(self, vocab_size: int) -> Tokenizer:
        """This tokenizer for a model whose vocabulary is smaller (a preset such as llama-2-13b,
        32000 ids, run with the bundled 49152-id tokenizer): ids past it wrap around.

        Wrapping keeps every prompt's token count, which is what a benchmark of random weights
        measures; rejecting the prompt, or widening the model's vocabulary, would not. Wrapped
        ids skip the control tokens at the start of the vocabulary, so text never turns into one.
        """
        folded = copy.copy(self)
        if vocab_size < self.vocab_size:
            folded._vocab_limit = vocab_size
            folded._fold_base = 1 + max((i for i in self.all_special_ids if i < vocab_size),
                                        default=-1)
        return folded

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        limit, base = self._vocab_limit, self._fold_base
        if limit is not None:
            ids = [i if i < limit else base + (i - base) % (limit - base) for i in ids]
        if add_special_tokens and self._add_bos:
            ids = [self._bos_id, *ids]  # type: ignore[list-item]  # _add_bos implies an id
        if add_special_tokens and self._add_eos:
            ids = [*ids, self._eos_id]  # type: ignore[list-item]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str | None: ...
    @overload
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]: ...

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    # --- model facts --------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer`: its normalizer and decoder tell what a token
        stands for (serve/openai/prompt_bound.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        size = self._tok.get_vocab_size(with_added_tokens=True)
        return size if self._vocab_limit is None else min(size, self._vocab_limit)

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self._bos_id, self._eos_id) if i is not None)
        limit = self._vocab_limit
        return sorted(i for i in ids if limit is None or i < limit)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def _token_str(self, token_id: int | None) -> str:
        text = None if token_id is None else self._tok.id_to_token(token_id)
        return text or ""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for a chat; extra keyword arguments (tools, enable_thinking, ...) reach
        the template."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead.")
        # As transformers: keys whose value is None are dropped (OpenAI clients send
        # `"content": null` beside tool_calls), templates handle a missing key, not a None.
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                    for m in messages]
        variables = {"bos_token": self._token_str(self._bos_id),
                     "eos_token": self._token_str(self._eos_id), **kwargs}
        return render_chat_template(self._chat_template, messages, add_generation_prompt, **variables)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a resolved model path (see `resolve_model_path`)."""
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    raise ValueError(f"{path}: expected a .gguf file or a HF folder with tokenizer.json.")


def load_bundled_tokenizer() -> Tokenizer:
    return Tokenizer.from_bundled()
