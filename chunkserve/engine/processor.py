"""The input processor (vLLM V1's `Processor`): a request checked and completed, once.

Both front ends call it, the server from its own threads (so a bad request is a 400 before it
ever reaches the engine loop) and the offline API through `LLMEngine.add_request`. What comes
out is an `EngineRequest` the engine trusts: token ids in the vocabulary, a prompt that fits,
and `max_tokens` an int.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import msgspec

from chunkserve.sampling_params import SamplingParams
from chunkserve.tokenizer.tokenizer import Tokenizer, TokenizerSpec

if TYPE_CHECKING:
    from chunkserve.engine.grammar import GrammarCompiler


class PromptTokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


@dataclass(frozen=True)
class EngineRequest:
    """A validated request (vLLM: `EngineCoreRequest`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens is an int
    eos_token_ids: list[int]
    arrival_time: float | None = None  # None: the engine's clock when it is added
    priority: int = 0
    # sampling_params.structured_outputs compiled (engine/grammar.py), when it is set.
    grammar: str | None = None


class ProcessorSpec(msgspec.Struct, frozen=True):
    """A Processor as data: what an engine process sends the API server (engine/wire.py)."""

    max_model_len: int
    vocab_size: int | None
    eos_token_ids: list[int]
    tokenizer: TokenizerSpec | None


class Processor:
    def __init__(
        self,
        max_model_len: int,
        vocab_size: int | None,
        tokenizer: PromptTokenizer | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        """`tokenizer` None: prompts must be token ids and outputs carry no text (the
        simulator); `vocab_size` None: ids are not range-checked (placeholder tokens)."""
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = list(eos_token_ids or [])
        self._grammars: GrammarCompiler | None = None  # made with the first structured request

    def spec(self) -> ProcessorSpec:
        tok = self.tokenizer
        if tok is not None and not isinstance(tok, Tokenizer):
            raise TypeError(f"a {type(tok).__name__} cannot be sent to another process")
        return ProcessorSpec(self.max_model_len, self.vocab_size, self.eos_token_ids,
                             None if tok is None else tok.spec())

    @classmethod
    def from_spec(cls, spec: ProcessorSpec) -> Processor:
        tok = None if spec.tokenizer is None else Tokenizer.from_spec(spec.tokenizer)
        return cls(spec.max_model_len, spec.vocab_size, tok, spec.eos_token_ids)

    def process_inputs(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("This engine has no tokenizer: prompts must be token ids.")
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        params = self.process_params(token_ids, params)
        grammar = (self.grammars().compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return EngineRequest(request_id, text, token_ids, params, self.eos_token_ids,
                             arrival_time, priority, grammar)

    @property
    def has_grammars(self) -> bool:
        """Whether any request with structured outputs has come (the engine's steps skip the
        grammar masks entirely until one has)."""
        return self._grammars is not None

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this processor's tokenizer (engine/grammar.py)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("Structured outputs need a tokenizer; this engine has none.")
            from chunkserve.engine.grammar import GrammarCompiler  # llguidance: only when used

            eos = self.eos_token_ids[0] if self.eos_token_ids else None
            self._grammars = GrammarCompiler(self.tokenizer, eos)
        return self._grammars

    def __getstate__(self) -> dict[str, object]:
        # Sent to a data-parallel API server: llguidance's tokenizer does not pickle, and the
        # receiving process makes its own.
        return {**self.__dict__, "_grammars": None}

    def process_params(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Checks a prompt against the model; returns params with max_tokens filled in."""
        self._check_logit_bias(params)
        max_tokens = self._max_tokens(token_ids, params)
        # replace() re-runs SamplingParams' checks (min_tokens <= max_tokens among them).
        return params if max_tokens == params.max_tokens else replace(params, max_tokens=max_tokens)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """vLLM's out-of-vocab check. The message starts with the bare field name (no colon):
        the server takes a 400's `param` from the first word."""
        vocab = self.vocab_size
        if vocab is None or not params.logit_bias:
            return
        invalid = [t for t in params.logit_bias if not 0 <= t < vocab]
        if invalid:
            raise ValueError(f"logit_bias is invalid: token_id(s) {invalid} in logit_bias contain "
                             f"out-of-vocab token ids. Vocabulary size: {vocab}")

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise ValueError("The prompt cannot be empty.")
        vocab = self.vocab_size
        if vocab is not None and any(not isinstance(t, int) or not 0 <= t < vocab
                                     for t in token_ids):
            raise ValueError(f"Token ids must be integers in [0, {vocab}).")
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages."
            )
        if params.max_tokens is None:
            return limit - n
        if params.max_tokens > limit - n:
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {limit} tokens and your request has "
                f"{n} input tokens ({params.max_tokens} > {limit} - {n})."
            )
        return params.max_tokens
