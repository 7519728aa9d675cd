"""Malformed requests, generated deterministically: every field with wrong types and
out-of-range numbers, token ids, empty and nested prompts, unicode edge cases, broken JSON,
oversized bodies, bad keys. Bodies are bytes: JSON's edges (NaN, 1e400, huge integers, lone
surrogate escapes, invalid UTF-8) are only reachable by writing the text by hand.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Kept short so that a case the server accepts costs little: the fuzz is about the edge.
CHEAP = {"max_tokens": 2}
CHAT_CHEAP = {"max_completion_tokens": 2}
USER = [{"role": "user", "content": "hi"}]


@dataclass
class Case:
    name: str
    path: str
    body: bytes | list[bytes]  # a list goes out chunked, with no content-length
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    auth: bool = True  # send the right API key
    send_body: bool = True  # False: the headers only (a declared length never sent)


# JSON text for values: wrong types, boundaries, values only Python's parser accepts.
BAD_VALUES: list[str] = [
    "null", "true", "false", "0", "-1", "1", "2", "-2", "0.5", "-0.5", "1.5", "-0.0",
    "2147483648", "-2147483649", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "18446744073709551616",
    "1" + "0" * 40, "-1" + "0" * 40, "1e30", "-1e30", "1e308", "1e400", "-1e400", "1e-400",
    "NaN", "Infinity", "-Infinity", '""', '"x"', '"1"', '"true"', '"\\ud800"', '"\\u0000"',
    "[]", "[1]", '["a"]', "[[]]", "[null]", "[-1]", "[18446744073709551616]", "{}",
    '{"a": 1}', '"' + "a" * 5000 + '"', "[" * 40 + "]" * 40,
]
COMMON_FIELDS = ["model", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
                 "stop_token_ids", "stream", "stream_options", "ignore_eos", "min_tokens",
                 "priority", "user"]
COMPLETION_FIELDS = [*COMMON_FIELDS, "prompt", "max_tokens", "logprobs", "echo"]
CHAT_FIELDS = [*COMMON_FIELDS, "messages", "max_completion_tokens", "max_tokens", "logprobs",
               "top_logprobs", "add_generation_prompt"]

UNICODE: list[tuple[str, str]] = [  # (name, JSON string literal)
    ("lone-high-surrogate", '"a\\ud800b"'), ("lone-low-surrogate", '"\\udc00"'),
    ("reversed-pair", '"\\ude00\\ud83d"'), ("valid-pair", '"\\ud83d\\ude00"'),
    ("nul", '"\\u0000\\u0000\\u0000"'), ("controls", '"' + "".join(f"\\u{i:04x}" for i in range(1, 32)) + '"'),
    ("bom", '"\\ufeffhello"'), ("rtl-override", '"abc\\u202edef"'), ("nonchar-ffff", '"\\uffff\\ufffe"'),
    ("private-use", '"\\ue000\\uf8ff"'), ("max-codepoint", '"\\udbff\\udfff"'),
    ("combining-x2000", '"a' + "\\u0301" * 2000 + '"'), ("zwj-family", '"\\ud83d\\udc68\\u200d\\ud83d\\udc69\\u200d\\ud83d\\udc67"'),
    ("replacement", '"\\ufffd\\ufffd"'), ("cjk", '"\u65e5\u672c\u8a9e\u30c6\u30ad\u30b9\u30c8"'),
    ("raw-utf8-emoji", '"\U0001F600 ok"'), ("whitespace-zoo", '"\\u2028\\u2029\\u00a0\\u3000\\t\\r\\n"'),
    ("only-space", '"   "'), ("empty", '""'), ("special-token-text", '"<|im_start|><|im_end|><|endoftext|>"'),
]
RAW_BODIES: list[tuple[str, bytes]] = [
    ("empty", b""), ("open-brace", b"{"), ("close-brace", b"}"), ("trailing-comma", b'{"prompt": "x",}'),
    ("single-quotes", b"{'prompt': 'x'}"), ("json-null", b"null"), ("json-array", b"[]"),
    ("json-string", b'"prompt"'), ("json-number", b"123"), ("json-true", b"true"),
    ("trailing-garbage", b'{"prompt": "x"} x'), ("two-objects", b'{"prompt": "x"}{"prompt": "y"}'),
    ("duplicate-keys", b'{"prompt": "x", "prompt": 5, "max_tokens": 2}'),
    ("deep-array", b"[" * 100_000 + b"]" * 100_000), ("deep-object-field", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("invalid-utf8", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'), ("overlong-utf8", b'{"prompt": "\xc0\xaf", "max_tokens": 2}'),
    ("cesu-surrogate", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'), ("utf8-bom", b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}'),
    ("utf16-body", '{"prompt": "x", "max_tokens": 2}'.encode("utf-16")), ("nul-bytes", b"\x00" * 64),
    ("bad-escape", b'{"prompt": "\\x41"}'), ("truncated-escape", b'{"prompt": "\\u12"}'),
    ("unterminated-string", b'{"prompt": "abc'), ("number-garbage", b'{"prompt": "x", "max_tokens": 1e}'),
    ("hex-number", b'{"prompt": "x", "max_tokens": 0x10}'), ("leading-zero", b'{"prompt": "x", "max_tokens": 02}'),
    ("plus-sign", b'{"prompt": "x", "max_tokens": +2}'), ("comment", b'{"prompt": "x" /* hi */}'),
    ("key-not-string", b'{prompt: "x"}'), ("huge-exponent", b'{"prompt": "x", "temperature": 1e99999999}'),
]


def _body(path: str, fields: dict[str, str], cheap: bool = True) -> bytes:
    """A JSON object from raw JSON texts, with a valid base so only the fuzzed field is wrong."""
    base = {**(CHEAP if path == COMPLETIONS else CHAT_CHEAP)} if cheap else {}
    base.update({"prompt": "hi"} if path == COMPLETIONS else {"messages": USER})
    parts = {k: json.dumps(v) for k, v in base.items()}
    parts.update(fields)
    return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in parts.items()) + "}").encode("utf-8", "surrogatepass")


def field_cases() -> Iterator[Case]:
    """Every field × every bad value, on both endpoints; every third one streamed."""
    i = 0
    for path, names in ((COMPLETIONS, COMPLETION_FIELDS), (CHAT, CHAT_FIELDS)):
        for name in names:
            for value in BAD_VALUES:
                fields = {name: value}
                if i % 3 == 0 and name not in ("stream", "stream_options"):
                    fields["stream"] = "true"
                i += 1
                yield Case(f"{path} {name}={value[:24]}", path, _body(path, fields))


def prompt_cases() -> Iterator[Case]:
    """Token ids, empty and nested prompts, prompts past the context."""
    prompts = [
        "[-1]", "[49152]", "[4294967296]", "[18446744073709551616]", "[0]", "[1, 2, 3]",
        "[1.5]", "[true]", '["a", 1]', "[1, \"a\"]", "[[1, 2], []]", "[[]]", "[[[1]]]",
        "[[1], [2.5]]", "[[-5]]", '[""]', '["", "x"]', '[["a"]]', "[" + ", ".join(["7"] * 5000) + "]",
        '"' + "word " * 3000 + '"', '"' + "x" * 200_000 + '"', "[" + ", ".join(['"a"'] * 300) + "]",
        '{"text": "x"}', "[{}]", "[null, null]",
    ]
    for p in prompts:
        for stream in ("false", "true"):
            yield Case(f"prompt={p[:24]} stream={stream}", COMPLETIONS,
                       _body(COMPLETIONS, {"prompt": p, "stream": stream}))


def unicode_cases() -> Iterator[Case]:
    for name, text in UNICODE:
        yield Case(f"unicode prompt {name}", COMPLETIONS, _body(COMPLETIONS, {"prompt": text}))
        yield Case(f"unicode prompt list {name}", COMPLETIONS, _body(COMPLETIONS, {"prompt": f"[{text}, \"ok\"]"}))
        yield Case(f"unicode stop {name}", COMPLETIONS, _body(COMPLETIONS, {"stop": f"[{text}]", "stream": "true"}))
        yield Case(f"unicode model {name}", COMPLETIONS, _body(COMPLETIONS, {"model": text}))
        yield Case(f"unicode unknown-field {name}", COMPLETIONS, _body(COMPLETIONS, {"x_extra": text}))
        yield Case(f"unicode key {name}", COMPLETIONS, _body(COMPLETIONS, {text[1:-1] or "k": "1"}))
        for key in ("content", "role", "name"):
            msg = '{"role": "user", "content": "hi"}'.replace('"user"' if key == "role" else '"hi"', text) \
                if key != "name" else '{"role": "user", "content": "hi", "name": ' + text + "}"
            yield Case(f"unicode chat {key} {name}", CHAT, _body(CHAT, {"messages": f"[{msg}]"}))
        yield Case(f"unicode tokenize {name}", "/tokenize", f'{{"prompt": {text}}}'.encode())


def chat_cases() -> Iterator[Case]:
    many = ", ".join('{"role": "user", "content": "hi"}' for _ in range(500))
    messages = [
        "[]", "[{}]", '[{"role": 1}]', '[{"role": "user"}]', '[{"content": "hi"}]',
        '[{"role": "user", "content": null}]', '[{"role": "user", "content": 5}]',
        '[{"role": "user", "content": []}]', '[{"role": "user", "content": [{}]}]',
        '[{"role": "user", "content": [{"type": "text"}]}]', '[{"role": "user", "content": [{"type": "text", "text": 1}]}]',
        '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
        '[{"role": "user", "content": {"text": "hi"}}]', '[{"role": "wizard", "content": "hi"}]',
        '[{"role": "assistant", "content": "hi"}]', '[{"role": "system", "content": "s"}]',
        '[{"role": "tool", "content": "x", "tool_call_id": 5}]', '[{"role": "user", "content": "hi", "name": 5}]',
        '[{"role": "user", "content": "hi", "tool_calls": "garbage"}]', f"[{many}]",
        '[{"role": "user", "content": "' + "fox " * 40000 + '"}]', '[{"role": "", "content": ""}]',
        '"hi"', "{}", "[null]", '[["user", "hi"]]',
    ]
    for m in messages:
        for stream in ("false", "true"):
            yield Case(f"messages={m[:30]} stream={stream}", CHAT, _body(CHAT, {"messages": m, "stream": stream}))
    for extra in ('{"stream": false, "stream_options": {"include_usage": true}}',
                  '{"logprobs": false, "top_logprobs": 3}', '{"logprobs": true, "top_logprobs": 21}',
                  '{"n": 3, "seed": 9223372036854775807, "temperature": 1}',
                  '{"stop": ["a", "b"], "stream": true, "stream_options": {"include_usage": "yes"}}'):
        fields = json.loads(extra)
        yield Case(f"chat combo {extra[:40]}", CHAT, _body(CHAT, {k: json.dumps(v) for k, v in fields.items()}))


def raw_cases() -> Iterator[Case]:
    for path in (COMPLETIONS, CHAT, "/tokenize", "/detokenize"):
        for name, body in RAW_BODIES:
            yield Case(f"raw {name} {path}", path, body, {"content-type": "application/json"})
    body = _body(COMPLETIONS, {})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  "application/json; charset=latin-1", "application/xml", ""):
        yield Case(f"content-type {ctype!r}", COMPLETIONS, body, {"content-type": ctype} if ctype else {})
    for method, path in (("GET", COMPLETIONS), ("PUT", CHAT), ("DELETE", "/tokenize"),
                         ("POST", "/v1/models"), ("GET", "/v1/nothing"), ("POST", "/health")):
        yield Case(f"{method} {path}", path, b"" if method == "GET" else body, method=method)


def size_and_auth_cases() -> Iterator[Case]:
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    yield Case("9 MiB body", COMPLETIONS, big, {"content-type": "application/json"})
    yield Case("9 MiB chunked body", COMPLETIONS, [big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)],
               {"content-type": "application/json"})
    yield Case("7 MiB prompt", COMPLETIONS, b'{"prompt": "' + b"hello " * ((7 << 20) // 6) + b'"}',
               {"content-type": "application/json"})
    yield Case("7 MiB chat content", CHAT, _body(CHAT, {"messages": json.dumps([{"role": "user", "content": "ab " * ((7 << 20) // 3)}])}))
    yield Case("declared 1 TiB", COMPLETIONS, b"", {"content-length": str(1 << 40)},
               send_body=False)
    yield Case("7 MiB stop list", COMPLETIONS, _body(COMPLETIONS, {"stop": json.dumps(["s"] * 400_000)}))
    for header in ("", "Bearer", "bearer stress-key", "Basic c3RyZXNz", "Bearer wrong",
                   "Bearer stress-key extra", "Bearer \u00e9\u00e8"):
        yield Case(f"auth {header!r}", COMPLETIONS, _body(COMPLETIONS, {}),
                   {"authorization": header} if header else {}, auth=False)


def all_cases(seed: int = 0) -> list[Case]:
    """Every case, deterministic for a seed: the order is shuffled so that no phase of the fuzz
    runs one kind of case only (and a keep-alive connection sees a mix)."""
    cases = [*field_cases(), *prompt_cases(), *unicode_cases(), *chat_cases(), *raw_cases(),
             *size_and_auth_cases()]
    for c in cases:
        if isinstance(c.body, bytes) and c.body[:1] == b"{" and "content-type" not in c.headers:
            c.headers["content-type"] = "application/json"
    random.Random(seed).shuffle(cases)
    return cases


def short_cases(num: int, seed: int = 0) -> list[Case]:
    """A sample for `make test`: every oversized or slow case dropped, the kinds kept mixed."""
    cheap = [c for c in all_cases(seed) if not c.name.startswith(("9 MiB", "7 MiB", "raw deep"))
             and (not isinstance(c.body, bytes) or len(c.body) < 100_000)]
    return cheap[:num]
