"""The OpenAI-compatible server end to end: a real `chunkserve serve` subprocess on a free port,
driven by the official `openai` client and raw httpx, as vLLM tests its server.

Most tests use the tiny random Llama (fast); SmolLM2 serves the tests that need real text or
requests long enough to disconnect from, overload or shut down in the middle of.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_utils import HTTP_TIMEOUT_S, RemoteServer, assert_error

from chunkserve import LLM, SamplingParams

MAX_LEN = 256
TINY = "tiny"  # the main tiny server's --served-model-name
TINY_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_LEN)]
# A prompt longer than the 32-token step budget, so the server chunks its prefill.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
IGNORE_EOS = {"ignore_eos": True}


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: str) -> Iterator[RemoteServer]:
    server = RemoteServer(tiny_model_dir, [*TINY_ARGS, "--max-num-batched-tokens", "32",
                                           "--served-model-name", TINY])
    yield server
    server.close()


@pytest.fixture(scope="module")
def _smol_server() -> Iterator[RemoteServer]:
    # One request at a time and one queued: the overload test needs exactly that, and the
    # disconnect tests are unaffected. Default max_model_len leaves room for long requests;
    # half a GiB of KV holds one request of it (8192 tokens: 0.35 GiB).
    server = RemoteServer("smollm2-135m", ["--dtype", "float32", "--max-num-seqs", "1",
                                           "--max-waiting-requests", "1",
                                           "--kv-cache-memory", "0.5"])
    yield server
    server.close()


@pytest.fixture
def smol(_smol_server: RemoteServer) -> RemoteServer:
    if not _smol_server.alive():  # the shutdown test stops it; restart for whoever comes next
        _smol_server.start()
    return _smol_server


@pytest.fixture(scope="module")
def offline(tiny_model_dir: str) -> LLM:
    return LLM(model=tiny_model_dir, dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(tiny: RemoteServer) -> openai.OpenAI:
    return tiny.client()


def greedy(n: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kwargs)


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any]]:
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any]]:
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def finish_reasons(chunks: list[Any]) -> list[str]:
    return [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]


# ---- 1. completions and chat ------------------------------------------------------------------


def test_completion_matches_offline_llm(tiny, client, offline):
    ref = offline.generate([PROMPT], greedy(12))[0]
    r = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) > 32
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_chat_matches_offline_llm(tiny, client, offline):
    ref = offline.chat(MESSAGES, greedy(10))
    r = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=10,
                                       temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_equals_non_stream_with_usage(client, kind):
    kw: dict[str, Any] = dict(model=TINY, max_tokens=9, temperature=0, extra_body=IGNORE_EOS)
    if kind == "completion":
        full = client.completions.create(prompt=PROMPT, **kw)
        full_text = full.choices[0].text
        text, chunks = stream_completion(client, prompt=PROMPT,
                                         stream_options={"include_usage": True},
                                         **kw)
    else:
        full = client.chat.completions.create(messages=MESSAGES, **kw)
        full_text = full.choices[0].message.content
        text, chunks = stream_chat(client, messages=MESSAGES,
                                   stream_options={"include_usage": True}, **kw)
        assert chunks[0].choices[0].delta.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 9
    assert text == full_text
    assert finish_reasons(chunks) == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    # Without include_usage no usage chunk comes.
    if kind == "completion":
        _, plain = stream_completion(client, prompt=PROMPT, **kw)
    else:
        _, plain = stream_chat(client, messages=MESSAGES, **kw)
    assert all(c.choices and c.usage is None for c in plain)


def test_stop_string_stream_and_not(client, offline):
    full = offline.generate([PROMPT], greedy(16, ignore_eos=True))[0].outputs[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), "the tiny model's text must contain a usable stop string"
    kw: dict[str, Any] = dict(model=TINY, prompt=PROMPT, max_tokens=16, temperature=0,
                              stop=[stop], extra_body=IGNORE_EOS)
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    text, chunks = stream_completion(client, **kw)
    assert text == r.choices[0].text and finish_reasons(chunks) == ["stop"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_token_ids(client, offline, kind):
    if kind == "completion":
        ref = offline.generate([PROMPT], greedy(10, ignore_eos=True))[0].outputs[0]
    else:
        ref = offline.chat(MESSAGES, greedy(10, ignore_eos=True)).outputs[0]
    stop_id = ref.token_ids[3]
    body = {"stop_token_ids": [stop_id], "ignore_eos": True}
    if kind == "completion":
        r = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body=body)
        text = r.choices[0].text
    else:
        r = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=10,
                                           temperature=0, extra_body=body)
        text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ref.token_ids.index(stop_id) + 1
    assert ref.text.startswith(text)


def test_n_and_prompt_lists(client):
    r = client.completions.create(model=TINY, prompt=PROMPT, n=2, max_tokens=5,
                                  temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 10
    chat = client.chat.completions.create(model=TINY, messages=MESSAGES, n=2, max_tokens=4,
                                          temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 8
    # A list of prompts: one choice each, in order, each as if it came alone.
    prompts = [PROMPT, "Hello there"]
    batch = client.completions.create(model=TINY, prompt=prompts, max_tokens=6, temperature=0,
                                      extra_body=IGNORE_EOS)
    assert [c.index for c in batch.choices] == [0, 1]
    alone = [client.completions.create(model=TINY, prompt=p, max_tokens=6, temperature=0,
                                       extra_body=IGNORE_EOS) for p in prompts]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 12
    # Sample j is seeded seed + j, wrapped into int64: the largest seed a client may send works.
    top = client.completions.create(model=TINY, prompt=PROMPT, n=3, max_tokens=2, temperature=1,
                                    seed=(1 << 63) - 1, extra_body=IGNORE_EOS)
    assert len(top.choices) == 3


def test_completion_logprobs_shape(client):
    r = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body=IGNORE_EOS)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(tok_lp, float) and tok_lp <= 0
        assert 1 <= len(top) <= 3 and top[tok] == tok_lp
        assert tok_lp == pytest.approx(max(top.values()))  # greedy took the best token


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob
    # Without logprobs there are none.
    plain = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stream_logprobs_equal_non_stream(client):
    """Also while text is held back (a stop string's prefix): no token's logprobs go missing,
    and streamed text_offsets continue where the previous chunk ended."""
    kw: dict[str, Any] = dict(model=TINY, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    full = client.completions.create(prompt=PROMPT, logprobs=1, **kw).choices[0].logprobs
    never = "".join(full.tokens[1:4]) + "\x07never"  # its prefix shows up, so text waits
    ref = client.completions.create(prompt=PROMPT, logprobs=1, stop=[never], **kw)
    assert ref.choices[0].logprobs.tokens == full.tokens
    _, chunks = stream_completion(client, prompt=PROMPT, logprobs=1, stop=[never], **kw)
    assert any(len(c.choices[0].logprobs.tokens) > 1 for c in chunks), "nothing was held back"
    got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in got:
            got[key] += getattr(c.choices[0].logprobs, key)
    assert got["tokens"] == full.tokens and got["text_offset"] == full.text_offset
    assert got["token_logprobs"] == pytest.approx(full.token_logprobs)

    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=1,
                                          **kw)
    tokens = [t.token for t in chat.choices[0].logprobs.content]
    never = "".join(tokens[1:4]) + "\x07never"
    _, chunks = stream_chat(client, messages=MESSAGES, logprobs=True, top_logprobs=1,
                            stop=[never], **kw)
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == tokens


def test_sse_wire_format(tiny):
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with tiny.http() as c:
        r = c.post("/v1/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3


# ---- 2. concurrency ---------------------------------------------------------------------------


def test_concurrent_streams_are_batched(tiny):
    num, max_tokens = 16, 24
    peak_running = 0.0
    done = threading.Event()

    def poll() -> None:
        nonlocal peak_running
        while not done.is_set():
            peak_running = max(peak_running, tiny.metrics().running)
            time.sleep(0.005)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=TINY, prompt=f"{i} {PROMPT}", max_tokens=max_tokens, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
        usage, reason = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for ch in chunk.choices:
                reason = ch.finish_reason or reason
        return usage, reason

    async def run_all() -> list[tuple[int, str | None]]:
        client = tiny.async_client()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(num))), 60)
        finally:
            await client.close()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        results = asyncio.run(run_all())
    finally:
        done.set()
        poller.join(10)
    assert results == [(max_tokens, "length")] * num
    assert peak_running > 1, "requests never ran together"
    tiny.wait_idle()


# ---- 3. errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, None),
    ({"prompt": "x", "top_p": 2}, None),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_validation_is_400(tiny, body, param):
    err = assert_error(tiny.post("/v1/completions", body), 400, "BadRequestError")
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "stream": False,
     "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
])
def test_chat_validation_is_400(tiny, body):
    assert_error(tiny.post("/v1/chat/completions", body), 400, "BadRequestError")


def test_invalid_json_is_400_not_422(tiny):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(tiny.url + path, content=b'{"prompt": "x",', timeout=HTTP_TIMEOUT_S,
                       headers={"content-type": "application/json"})
        assert_error(r, 400, "BadRequestError", "JSON")


@pytest.mark.parametrize(("path", "raw", "param"), [
    # Integers past 64 bits used to fail the whole engine step ("Overflow when unpacking").
    ("/v1/completions", '{"prompt": "x", "top_k": 18446744073709551616}', "top_k"),
    ("/v1/completions", '{"prompt": "x", "seed": 18446744073709551616, "temperature": 1}', "seed"),
    ("/v1/completions", '{"prompt": "x", "seed": -9223372036854775809}', "seed"),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [18446744073709551616]}',
     "stop_token_ids"),
    ("/v1/completions", '{"prompt": "x", "priority": 9223372036854775808}', "priority"),
    ("/v1/completions", '{"prompt": "x", "n": 16385}', "n"),
    ("/v1/completions", '{"prompt": "x", "top_k": 1e30}', "top_k"),
    # inf (Python's JSON parser reads 1e400 and Infinity) used to make NaN probabilities.
    ("/v1/completions", '{"prompt": "x", "temperature": 1e400, "min_tokens": 1}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                             '"top_p": Infinity}', "top_p"),
    # A lone surrogate is no text a tokenizer (or the error body's encoder) accepts.
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udc00"]}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_bad_input_is_400_and_keeps_the_connection(tiny, path, raw, param):
    from stress.wire import KeepAliveClient

    conn = KeepAliveClient("127.0.0.1", tiny.port, timeout=HTTP_TIMEOUT_S)
    try:
        r = conn.request("POST", path, raw.encode(), {"content-type": "application/json"})
        assert r.status == 400, r.body
        err = json.loads(r.body)["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
        # The next request on the same keep-alive connection is served (it used to be reset).
        ok = conn.request("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}',
                          {"content-type": "application/json"})
        assert ok.status == 200 and conn.reused
    finally:
        conn.close()


def test_hopelessly_long_prompt_is_refused_without_tokenizing(tiny):
    t0 = time.monotonic()
    r = tiny.post("/v1/completions", {"prompt": "hello world " * 400_000})  # 4.8 MB
    took = time.monotonic() - t0
    assert_error(r, 400, "BadRequestError", f"This model's maximum context length is {MAX_LEN}")
    assert "at least" in r.json()["error"]["message"]
    assert took < 2.0, took  # tokenizing it took ~5 s


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY, prompt="x", top_p=2)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)


def test_context_length_errors(tiny):
    too_long = [300 + i for i in range(MAX_LEN)]
    assert_error(tiny.post("/v1/completions", {"prompt": too_long}), 400, "BadRequestError",
                 f"This model's maximum context length is {MAX_LEN} tokens. However, your "
                 f"request has {MAX_LEN} input tokens. Please reduce the length of the input "
                 "messages.")
    long_chat = [{"role": "user", "content": "fox " * 300}]
    n = tiny.post("/tokenize", {"messages": long_chat}).json()["count"]
    assert n > MAX_LEN
    assert_error(tiny.post("/v1/chat/completions", {"messages": long_chat}), 400,
                 "BadRequestError",
                 f"This model's maximum context length is {MAX_LEN} tokens. However, your "
                 f"request has {n} input tokens.")
    prompt = [300 + i for i in range(10)]
    x = MAX_LEN - 10 + 1
    assert_error(tiny.post("/v1/completions", {"prompt": prompt, "max_tokens": x}), 400,
                 "BadRequestError",
                 f"'max_tokens' or 'max_completion_tokens' is too large: {x}. This model's "
                 f"maximum context length is {MAX_LEN} tokens and your request has 10 input "
                 f"tokens ({x} > {MAX_LEN} - 10).")
    p = tiny.post("/tokenize", {"messages": MESSAGES}).json()["count"]
    assert_error(tiny.post("/v1/chat/completions",
                           {"messages": MESSAGES, "max_completion_tokens": MAX_LEN}),
                 400, "BadRequestError",
                 f"'max_tokens' or 'max_completion_tokens' is too large: {MAX_LEN}. This "
                 f"model's maximum context length is {MAX_LEN} tokens and your request has "
                 f"{p} input tokens")
    # At the limit exactly, it runs: max_tokens = max_model_len - prompt (a long prompt, so
    # that reaching the limit takes a few decode steps, not hundreds).
    long_prompt = [300 + i for i in range(MAX_LEN - 4)]
    r = tiny.post("/v1/completions", {"prompt": long_prompt, "max_tokens": 4,
                                      "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_LEN


def test_not_found_and_too_large(tiny):
    assert_error(tiny.post("/v1/completions", {"model": "nope", "prompt": "x"}), 404,
                 "NotFoundError", "nope", param="model")
    assert_error(tiny.post("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}),
                 404, "NotFoundError", param="model")
    assert_error(httpx.get(tiny.url + "/v1/nothing-here", timeout=HTTP_TIMEOUT_S), 404,
                 "NotFoundError")
    big = json.dumps({"prompt": "x" * (8 << 20)}).encode()
    r = httpx.post(tiny.url + "/v1/completions", content=big, timeout=HTTP_TIMEOUT_S,
                   headers={"content-type": "application/json"})
    assert_error(r, 413)

    def chunked():  # no content-length: the limit must hold while the body streams in
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(tiny.url + "/v1/completions", content=chunked(), timeout=HTTP_TIMEOUT_S,
                   headers={"content-type": "application/json"})
    assert_error(r, 413)
    # After all of the above the server still serves.
    r = tiny.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    tiny.wait_idle()


def test_api_key(tiny_model_dir):
    key = "sk-test-123"
    server = RemoteServer(tiny_model_dir, TINY_ARGS, api_key=key)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                r = httpx.request(method, server.url + path, headers=headers,
                                  json={"prompt": "x", "max_tokens": 1},
                                  timeout=HTTP_TIMEOUT_S)
                err = assert_error(r, 401, "AuthenticationError", "Unauthorized")
                assert err["param"] is None and r.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        good = server.client()
        assert good.models.list().data[0].id == tiny_model_dir
        r = good.completions.create(model=tiny_model_dir, prompt="Hi", max_tokens=2,
                                    extra_body=IGNORE_EOS)
        assert r.usage.completion_tokens == 2
        # Probes stay open, as in vLLM; everything else needs the key.
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S).status_code == 200
        # The web page's static files too (they ask for the key); its step stream needs it.
        assert httpx.get(server.url + "/", timeout=HTTP_TIMEOUT_S).status_code == 200
        assert_error(httpx.get(server.url + "/engine/steps", timeout=HTTP_TIMEOUT_S), 401)
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]}),
                           ("/reset_prefix_cache", None)):
            r = httpx.post(server.url + path, json=body, timeout=HTTP_TIMEOUT_S)
            assert_error(r, 401, "AuthenticationError")
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}, headers=auth,
                       timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200
        # Without --enable-dev-endpoints the reset endpoint does not exist, as in vLLM.
        r = httpx.post(server.url + "/reset_prefix_cache", headers=auth, timeout=HTTP_TIMEOUT_S)
        assert_error(r, 404)
        # Two Authorization headers: refused, whichever of them is right.
        two = [("Authorization", f"Bearer {key}"), ("Authorization", "Bearer wrong")]
        for headers in (two, two[::-1]):
            r = httpx.get(server.url + "/v1/models", headers=headers, timeout=HTTP_TIMEOUT_S)
            assert_error(r, 400, "BadRequestError", "one Authorization header")
    finally:
        assert server.terminate() == 0
        server.close()


def test_overload_is_503_with_retry_after(smol):
    """--max-num-seqs 1 --max-waiting-requests 1: one running, one waiting, the third is 503."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=smol.url, timeout=HTTP_TIMEOUT_S) as c:
            first = asyncio.Event()

            async def hold(b: dict[str, Any]) -> None:
                async with c.stream("POST", "/v1/completions", json=b) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            first.set()

            running = asyncio.create_task(hold(body))
            await asyncio.wait_for(first.wait(), 20)
            waiting = asyncio.create_task(hold(body))
            deadline = time.monotonic() + 10
            while (await asyncio.to_thread(smol.metrics)).waiting != 1:
                assert time.monotonic() < deadline, "the second request never queued"
                await asyncio.sleep(0.02)
            try:
                return await c.post("/v1/completions", json={**body, "stream": False})
            finally:
                for task in (running, waiting):
                    task.cancel()
                await asyncio.gather(running, waiting, return_exceptions=True)

    r = asyncio.run(asyncio.wait_for(run(), 60))
    assert_error(r, 503, "ServiceUnavailableError", "--max-waiting-requests 1")
    assert r.headers["retry-after"] == "1"
    smol.wait_idle()
    # Both cancelled requests were aborted; the server serves again.
    r = smol.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_request_bigger_than_the_cap_is_400_not_503(smol):
    """--max-waiting-requests 1: n=2, or two prompts, could never be admitted."""
    for extra in ({"n": 2}, {"prompt": ["a", "b"]}):
        r = smol.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **extra})
        assert_error(r, 400, "BadRequestError", "--max-waiting-requests 1", param="n")
        assert "retry-after" not in r.headers
    r = smol.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "n": 2})
    assert_error(r, 400, "BadRequestError", "2 sequences", param="n")


# ---- 4. disconnects ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_kv(smol, stream):
    max_tokens = 300  # ~10 s of SmolLM2 decoding on 2 cores
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    before = smol.metrics()
    t0 = time.monotonic()
    with smol.http() as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        break  # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    after = smol.wait_idle(timeout=5)
    elapsed = time.monotonic() - t0
    aborted = (after.get("vllm:request_success_total", finished_reason="abort")
               - before.get("vllm:request_success_total", finished_reason="abort"))
    generated = (after.get("vllm:generation_tokens_total")
                 - before.get("vllm:generation_tokens_total"))
    assert aborted == 1
    # Stopped well before it would have finished (which takes ~10 s at ~30 tokens/s).
    assert generated < max_tokens / 2, (generated, elapsed)
    assert after.get("vllm:request_success_total", finished_reason="length") == before.get(
        "vllm:request_success_total", finished_reason="length")


# ---- 5. metrics -------------------------------------------------------------------------------


def test_metrics_count_served_requests(tiny_model_dir, offline):
    name = "tiny-served"
    server = RemoteServer(tiny_model_dir, [*TINY_ARGS, "--served-model-name", name])
    try:
        m0 = server.metrics()
        assert m0.get("vllm:time_to_first_token_seconds_count") == 0
        for reason in ("stop", "length", "abort"):  # the series exist before any request
            assert m0.get("vllm:request_success_total", finished_reason=reason) == 0
        client = server.client()
        assert [m.id for m in client.models.list().data] == [name]
        usages = []
        for _ in range(2):
            usages.append(client.completions.create(
                model=name, prompt=PROMPT, max_tokens=4, extra_body=IGNORE_EOS).usage)
        chunks = list(client.completions.create(
            model=name, prompt="Hi", max_tokens=5, extra_body=IGNORE_EOS, stream=True,
            stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage)
        chunks = list(client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=3, extra_body=IGNORE_EOS, stream=True,
            stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage)
        ref = offline.generate([PROMPT], greedy(8, ignore_eos=True))[0].outputs[0]
        r = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=0,
            extra_body={"stop_token_ids": [ref.token_ids[2]], "ignore_eos": True})
        assert r.choices[0].finish_reason == "stop"
        usages.append(r.usage)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=tiny_model_dir, prompt="x")

        m = server.metrics()
        assert m.model_names == {name}
        assert m.families["vllm:time_to_first_token_seconds"].type == "histogram"
        assert m.families["vllm:request_success"].type == "counter"
        assert m.families["vllm:num_requests_running"].type == "gauge"
        served = len(usages)
        for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                     "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
            assert m.get(f"{hist}_count") == served, hist
            assert m.get(f"{hist}_bucket", le="+Inf") == served, hist
        assert m.get("vllm:request_success_total", finished_reason="length") == served - 1
        assert m.get("vllm:request_success_total", finished_reason="stop") == 1
        assert m.get("vllm:request_success_total", finished_reason="abort") == 0
        assert m.get("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert m.get("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
        assert m.get("vllm:request_generation_tokens_sum") == sum(
            u.completion_tokens for u in usages)
        assert m.idle
    finally:
        server.close()


# ---- 6. the other endpoints -------------------------------------------------------------------


def test_models_version_health(tiny, client, tiny_model_dir):
    # --served-model-name: clients see that id; `root` names what is served.
    r = httpx.get(tiny.url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert r["object"] == "list" and len(r["data"]) == 1
    card = r["data"][0]
    assert card["id"] == TINY and card["object"] == "model" and card["root"] == tiny_model_dir
    assert card["max_model_len"] == MAX_LEN
    assert {"created", "owned_by", "root"} <= set(card)
    assert [m.id for m in client.models.list().data] == [TINY]
    assert isinstance(httpx.get(tiny.url + "/version", timeout=HTTP_TIMEOUT_S)
                      .json()["version"], str)
    h = httpx.get(tiny.url + "/health", timeout=HTTP_TIMEOUT_S)
    assert h.status_code == 200 and h.content == b""


def test_tokenize_detokenize(tiny, client, offline):
    tok = offline.get_tokenizer()
    r = tiny.post("/tokenize", {"model": TINY, "prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    back = tiny.post("/detokenize", {"model": TINY, "tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    # Messages tokenize as the chat endpoint prompts them.
    m = tiny.post("/tokenize", {"messages": MESSAGES}).json()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert m["tokens"] == tok.encode(text, add_special_tokens=False)
    chat = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=1)
    assert m["count"] == chat.usage.prompt_tokens
    assert tiny.post("/detokenize", {"tokens": m["tokens"]}).json()["prompt"] == text
    assert_error(tiny.post("/detokenize", {"tokens": [10**9]}), 400, param="tokens")
    assert_error(tiny.post("/tokenize", {"prompt": "x", "model": "nope"}), 404)
    assert_error(tiny.post("/tokenize", {}), 400)


# ---- real text --------------------------------------------------------------------------------


def test_smollm2_chat_real_text(smol):
    client = smol.client()
    q = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=q, max_tokens=30,
                                       temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer and r.choices[0].finish_reason == "stop"  # the model's own EOS
    assert r.usage.completion_tokens < 30
    cut = client.chat.completions.create(model="smollm2-135m", messages=q, max_tokens=30,
                                         temperature=0, stop=["Paris"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == answer[: answer.index("Paris")]
    text, chunks = stream_chat(client, model="smollm2-135m", messages=q, max_tokens=30,
                               temperature=0, stop=["Paris"])
    assert text == cut.choices[0].message.content and finish_reasons(chunks) == ["stop"]


# ---- 7. graceful shutdown (last: it stops the SmolLM2 server) ---------------------------------


def test_sigterm_ends_inflight_streams_with_an_error_and_done(smol):
    """The stream outlives the grace period (5 s, the default --shutdown-timeout): it must end
    with an error event and [DONE], not be cut, and the process must exit 0 within 5 s."""
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines: list[str] = []
    ended: list[BaseException | None] = []
    first = threading.Event()

    def consume() -> None:
        try:
            with httpx.stream("POST", smol.url + "/v1/completions", json=body,
                              timeout=HTTP_TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        first.set()
            ended.append(None)
        except httpx.HTTPError as e:  # cut mid-stream: the defect this test guards against
            ended.append(e)
        finally:
            first.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert first.wait(30) and lines, "the stream never started"
    assert smol.proc is not None
    t0 = time.monotonic()
    smol.proc.terminate()
    try:
        code = smol.proc.wait(15)
    except Exception:
        smol.proc.kill()
        raise
    exited = time.monotonic() - t0
    reader.join(10)
    assert code == 0 and exited <= 5.0, (code, exited, smol.log_tail())
    assert ended == [None], ended
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "ServiceUnavailableError" and "shutting down" in error["message"]
    assert 1 < len(lines) < 1000  # it was in flight, not finished, when the signal came
    log = smol.log_tail(10**7)
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


def test_echo_prepends_the_prompt(tiny):
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = tiny.post("/v1/completions", body).json()["choices"][0]["text"]
    echoed = tiny.post("/v1/completions", {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "Hello there" + plain
    # echo with logprobs (the prompt's logprobs first): tests/test_request_fields.py
