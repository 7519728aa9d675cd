"""Incremental detokenization and stop-string matching (after vLLM's `IncrementalDetokenizer`).

Decoding the whole output after every token costs O(length) per token. Instead we
keep two offsets into the token list: tokens in [prefix_offset, read_offset) have
already been turned into text and serve only as context, tokens from read_offset on
are new. The new text is decode(prefix + new) minus decode(prefix). Context
matters because tokenizers render a token differently at the start of a string
(e.g. SentencePiece drops the leading space of "▁word"). While the result ends in
"\\ufffd" the new tokens hold only part of a UTF-8 character, so we emit nothing and
wait for the tokens that complete it.
"""
from __future__ import annotations

from typing import Protocol

from chunkserve.sampling_params import SamplingParams

# Prompt tokens used as decoding context for the first output token (vLLM's value).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings: list[str] = list(params.stop_strings)
        self.min_tokens: int = params.min_tokens
        # While streaming, hold back text that might be the start of a stop string.
        self.stop_buffer_length: int = max((len(s) for s in self.stop_strings), default=1) - 1

        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens: int = len(prompt_token_ids)
        self.prefix_offset: int = max(len(prompt_token_ids) - INITIAL_CONTEXT_TOKENS, 0)
        self.read_offset: int = len(prompt_token_ids)

        self.output_text: str = ""
        self.stop_reason: str | None = None  # the stop string that ended the output
        self._sent_offset: int = 0  # chars of output_text already handed out as deltas

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now ends the output, else None.

        On a match output_text is cut just before the stop string (vLLM's
        include_stop_str_in_output=False). Tokens after a stop are ignored.
        """
        if self.stopped:
            return None
        old_len = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_next()

        # vLLM checks stop strings only once the output is longer than min_tokens.
        if not self.stop_strings or len(self.output_token_ids) <= self.min_tokens:
            return None
        match = self._find_stop(old_len)
        if match is None:
            return None
        stop, index = match
        self.output_text = self.output_text[:index]
        self.stop_reason = stop
        return stop

    def get_next_delta(self, finished: bool = False) -> str:
        """Text added since the last call; keeps back a possible stop-string prefix
        until `finished` (or a stop string has ended the output)."""
        hold = 0 if finished or self.stopped else self.stop_buffer_length
        end = max(len(self.output_text) - hold, self._sent_offset)
        delta = self.output_text[self._sent_offset : end]
        self._sent_offset = end
        return delta

    def _decode_next(self) -> str:
        """Text that the tokens from read_offset on add, or "" while it is incomplete."""
        window = self.token_ids[self.prefix_offset :]
        split = self.read_offset - self.prefix_offset
        prefix_text = self.tokenizer.decode(window[:split], skip_special_tokens=self.skip_special_tokens)
        new_text = self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or a partial character:
            # keep the offsets so the next token is decoded together with these.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _find_stop(self, old_len: int) -> tuple[str, int] | None:
        """Earliest stop string that overlaps the text added after `old_len`.

        A match must end in the new text, so it starts at most len(stop)-1 chars
        before it. Taking the earliest position (vLLM takes the first stop in list
        order) keeps the output from running past a stop string that came first.
        """
        best: tuple[str, int] | None = None
        for stop in self.stop_strings:
            index = self.output_text.find(stop, max(old_len - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[1]):
                best = (stop, index)
        return best
