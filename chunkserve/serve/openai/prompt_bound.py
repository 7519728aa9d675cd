"""A lower bound on a text's token count that costs no tokenization.

Tokenizing is the one step of a request whose cost grows with what the client sends: a few MiB
of text take seconds of CPU (a 5 MB prompt took 7 s here), only for the prompt to be refused as
longer than the context. With byte-level BPE (SmolLM2, Llama 3, Qwen: `gpt2` GGUF vocabularies)
each token stands for a fixed run of the text's UTF-8 bytes, at most `max_token_bytes` long, so
a text of B bytes has at least B // max_token_bytes tokens and one far past the context can be
refused at once. A normalizer may shrink text before that split (NFKC, lowercasing, stripping),
and other decoders do not give a token's bytes back exactly: such tokenizers (SentencePiece
vocabularies: Llama 2, Mistral, Phi-3 GGUFs) get no bound.
"""
from __future__ import annotations

from typing import Any

from tokenizers import decoders


class TokenCountBound:
    def __init__(self, tokenizer: Any) -> None:
        self.max_token_bytes = 0  # 0: no bound
        # chunkserve's Tokenizer wraps a `tokenizers.Tokenizer` (the one object that can tell
        # its normalizer and decoder); anything else gets no bound.
        inner = getattr(tokenizer, "hf_tokenizer", None)
        if (inner is None or inner.normalizer is not None
                or not isinstance(inner.decoder, decoders.ByteLevel)):
            return
        # Every id, also past a folded vocabulary, and added tokens matched whole in the text.
        size = inner.get_vocab_size(with_added_tokens=True)
        self.max_token_bytes = max(
            len(inner.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(size)
        )

    def at_least(self, text: str) -> int:
        """Tokens `text` has at the least (special tokens added by encoding not counted); 0 when
        this tokenizer has no bound."""
        if self.max_token_bytes <= 0:
            return 0
        return len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes
