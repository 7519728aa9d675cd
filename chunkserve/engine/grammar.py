"""Structured outputs (issue 31): a request's grammar, compiled by llguidance, turned into a mask
of the tokens its next sample may take.

llguidance, not xgrammar: on this CPU both fill a 32-row mask in well under a decode step, and
llguidance installs with no dependencies and builds its tokenizer from the `tokenizers` JSON the
engine already holds (docs/performance.md, "Structured outputs: xgrammar against llguidance").

The Processor compiles a request's grammar when it checks the request (`compile`, on the
server's request threads, so a bad schema is a 400 and the engine thread never compiles); the
engine makes the request's matcher from it when the request arrives, fills the mask rows of the
requests that sample each step (`fill`), and feeds each sampled token back (`advance`). A
preempted request keeps its matcher: recomputing its KV changes none of its tokens.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import llguidance
import llguidance.numpy as lgnp
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from chunkserve.sampling_params import StructuredOutputsParams

Matcher = Any  # llguidance.LLMatcher
log = logging.getLogger("chunkserve.engine")


class GrammarCompiler:
    """llguidance over one tokenizer; made lazily, once, per Processor (and per process: an
    LLTokenizer does not pickle, so a data-parallel API server makes its own)."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None) -> None:
        """`tokenizer`: chunkserve's Tokenizer (its `tokenizers` JSON and vocabulary size)."""
        self.vocab_size: int = tokenizer.vocab_size
        hf = tokenizer.hf_tokenizer
        self._tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=eos_token_id)

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of `spec`; a ValueError naming the problem if it does not
        compile (an invalid schema or regex, an unsupported keyword)."""
        grammar = _grammar_text(spec)
        error = self._error(grammar)
        if error and spec.json is not None and not spec.strict:
            # Not strict: what llguidance cannot enforce (an unimplemented keyword, an unknown
            # format) is left out, as long as the schema itself is valid.
            lenient = _grammar_text(spec, lenient=True)
            if not self._error(lenient):
                log.warning("structured output (strict: false): not enforcing %s", error[:300])
                return lenient
        if error:
            raise ValueError(f"The structured output's {_kind(spec)} is invalid: "
                             f"{error[:500]}")
        return grammar

    def _error(self, grammar: str) -> str:
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        return " ".join(error.split()) if error else ""  # llguidance's message spans lines

    def matcher(self, grammar: str) -> Matcher:
        m = llguidance.LLMatcher(self._tokenizer, grammar)
        if m.is_error():
            raise ValueError(f"The structured output's grammar is invalid: {m.get_error()}")
        return m

    def fill(self, matchers: list[Matcher]) -> tuple[np.ndarray, dict[int, str]]:
        """int32 [len(matchers), ceil(vocab / 32)]: bit t of row i set where matcher i allows
        token t next; and the rows whose matcher could not fill one (row -> why), which the
        engine fails alone."""
        mask = lgnp.allocate_token_bitmask(len(matchers), self.vocab_size)
        failed: dict[int, str] = {}
        for i, m in enumerate(matchers):
            try:
                if m.is_error():
                    raise RuntimeError(m.get_error())
                lgnp.fill_next_token_bitmask(m, mask, i)
            except Exception as e:  # noqa: BLE001 - this request's grammar alone
                failed[i] = f"its structured output's grammar cannot go on: {e}"
        return mask, failed


def advance(matcher: Matcher, token: int) -> bool:
    """Feeds the sampled token; True once the grammar is complete (the request should stop).
    A RuntimeError when the grammar refuses it (only a mask that let it through could)."""
    if not matcher.is_stopped() and not matcher.consume_token(token):
        raise RuntimeError(f"its structured output's grammar refused token {token}: "
                           f"{matcher.get_error()}")
    return bool(matcher.is_stopped())


def _kind(spec: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(spec, name) not in (None, False)).replace("json", "JSON schema", 1)


# JSON's separators without free whitespace around them: with it, a small model (SmolLM2,
# tested) can spend the rest of max_tokens on newlines after the last value, a valid prefix the
# grammar cannot end. vLLM's `disable_any_whitespace`; a schema's own "x-guidance" wins.
JSON_DEFAULTS = {"whitespace_flexible": False}


def _grammar_text(spec: StructuredOutputsParams, lenient: bool = False) -> str:
    M = llguidance.LLMatcher
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        defaults = {**JSON_DEFAULTS, "lenient": True} if lenient else JSON_DEFAULTS
        return M.grammar_from_json_schema(schema, defaults=defaults)
    if spec.json_object:
        return M.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_DEFAULTS)
    if spec.regex is not None:
        return M.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # A Lark rule of string literals (JSON's escapes are Lark's): no regex escaping rules
        # to get right between Python's and Rust's syntax.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    text = spec.grammar
    return M.grammar_from_lark(gbnf_to_lark(text) if "::=" in text else text)
