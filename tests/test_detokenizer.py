"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE)."""
from __future__ import annotations

import pytest

from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Hello 👋🏽 世界! 日本語のテキスト",
    "emoji run: 🤖🚀🧠👨‍👩‍👧 and done",
    "café naïve façade — “quotes” ½ ∑ ∞",
    "  leading spaces\n\nnewlines\tand tabs  ",
    "def f(x):\n    return x ** 2  # 平方",
    "한국어 텍스트와 中文混合 text",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_tokenizer):  # type: ignore[no-untyped-def]
    return smollm2_hf_tokenizer  # transformers' tokenizer for the SmolLM2 GGUF (conftest)


def encode(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tok.encode(text, add_special_tokens=False)


def make(tok, prompt: str = "The answer is:", **kw: object) -> IncrementalDetokenizer:  # type: ignore[no-untyped-def]
    return IncrementalDetokenizer(tok, encode(tok, prompt), SamplingParams(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, text)
    detok = make(tokenizer)
    deltas = []
    for t in ids:
        assert detok.update([t]) is None
        assert not detok.output_text.endswith("\ufffd")
        deltas.append(detok.get_next_delta())
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.output_text == full
    assert "".join(deltas) + detok.get_next_delta(finished=True) == full


def test_multibyte_chars_split_across_tokens_are_held(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, "👋🏽")
    assert len(ids) > 2  # the emoji really is split over several byte tokens
    detok = make(tokenizer)
    seen = []
    for t in ids:
        detok.update([t])
        seen.append(detok.output_text)
    assert all("\ufffd" not in s for s in seen)
    assert seen[0] == ""  # first byte alone is not a character yet
    assert seen[-1] == "👋🏽"


def test_update_with_several_tokens_at_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, TEXTS[1])
    detok = make(tokenizer)
    for i in range(0, len(ids), 3):
        detok.update(ids[i : i + 3])
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_skipped_or_kept(tokenizer) -> None:  # type: ignore[no-untyped-def]
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Hi there") + [eos]
    skip = make(tokenizer)
    skip.update(ids)
    assert skip.output_text == "Hi there"
    keep = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=False)
    keep.update(ids)
    assert keep.output_text == tokenizer.decode(ids, skip_special_tokens=False)


def test_empty_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, TEXTS[2])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for t in ids:
        detok.update([t])
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def feed_until_stop(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, list[str]]:
    deltas = []
    for t in ids:
        stop = detok.update([t])
        deltas.append(detok.get_next_delta())
        if stop is not None:
            return stop, deltas
    return None, deltas


def test_stop_string_across_token_boundaries(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "The quick brown fox jumps over the lazy dog. Then more text."
    ids = encode(tokenizer, text)
    stop = "over the la"  # spans several tokens and ends mid-token
    detok = make(tokenizer, stop=[stop])
    found, deltas = feed_until_stop(detok, ids)
    assert found == stop
    assert detok.output_text == "The quick brown fox jumps "
    assert "".join(deltas) == detok.output_text
    assert detok.update(encode(tokenizer, " ignored")) is None
    assert detok.output_text == "The quick brown fox jumps "


def test_stop_string_inside_multibyte_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, "日本語のテキスト and more")
    detok = make(tokenizer, stop="テキ")
    found, deltas = feed_until_stop(detok, ids)
    assert found == "テキ"
    assert detok.output_text == "日本語の"
    assert "".join(deltas) == "日本語の"


def test_earliest_stop_string_wins(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, "alpha beta gamma")
    detok = make(tokenizer, stop=["gamma", "beta"])
    detok.update(ids)  # both appear in one update: cut at the first occurrence
    assert detok.stop_reason == "beta"
    assert detok.output_text == "alpha "


def test_stop_strings_ignored_within_min_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, "stop here, then stop again")
    detok = make(tokenizer, stop="stop", min_tokens=3, max_tokens=50)
    found, _ = feed_until_stop(detok, ids)
    assert found == "stop"
    assert detok.output_text == "stop here, then "


def test_held_back_stop_prefix_flushed_when_finished(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, "Result: END")
    detok = make(tokenizer, stop="ENDING")
    found, deltas = feed_until_stop(detok, ids)
    assert found is None
    streamed = "".join(deltas)
    # Up to len("ENDING") - 1 = 5 trailing chars are held back: they might grow into the stop.
    assert detok.output_text == "Result: END"
    assert detok.output_text.startswith(streamed)
    assert len(detok.output_text) - len(streamed) == 5
    assert streamed + detok.get_next_delta(finished=True) == "Result: END"
    assert detok.get_next_delta(finished=True) == ""


def test_no_stop_strings_streams_everything(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode(tokenizer, "abc def")
    detok = make(tokenizer)
    _, deltas = feed_until_stop(detok, ids)
    assert "".join(deltas) == "abc def"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_cost_is_bounded_per_token(tokenizer) -> None:  # type: ignore[no-untyped-def]
    counting = CountingTokenizer(tokenizer)
    ids = encode(tokenizer, " ".join(TEXTS) * 4)
    assert len(ids) > 200
    detok = IncrementalDetokenizer(counting, encode(tokenizer, "x " * 50), SamplingParams())
    for t in ids:
        detok.update([t])
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(counting.sizes) <= 16  # a small window, never the whole sequence
