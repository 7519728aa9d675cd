"""Request validation, error bodies and response shapes of the OpenAI-compatible protocol."""
from __future__ import annotations

import json
import math
import re

import pytest
from pydantic import ValidationError

from chunkserve.serve.openai.chat_protocol import ChatCompletionRequest, TokenizeRequest
from chunkserve.serve.http.errors import error_body, validation_error_message
from chunkserve.serve.openai.bodies import (
    chat_chunk,
    chat_choice,
    chat_completion_id,
    chat_delta,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_id,
    completion_logprobs,
    completion_response,
    usage,
    usage_chunk,
)
from chunkserve.serve.openai.protocol import (
    MAX_SEQUENCES,
    CompletionRequest,
    DetokenizeRequest,
    find_lone_surrogate,
)

USER = [{"role": "user", "content": "hi"}]
STREAM_MSG = "Stream options can only be defined when `stream=True`."


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=USER, **kw)


# --- defaults and mapping -----------------------------------------------------------------------


def test_completion_defaults() -> None:
    req = CompletionRequest(prompt="hello")
    assert req.max_tokens == 16 and req.n == 1 and not req.stream and req.priority == 0
    sp = req.to_sampling_params(default_max_tokens=999)
    assert sp.max_tokens == 16  # OpenAI's completions default, not the context budget
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1.0, 1.0, 0, 0.0)
    assert sp.logprobs is None and sp.stop_strings == [] and sp.stop_token_ids == []


def test_completion_explicit_null_max_tokens_uses_default() -> None:
    req = CompletionRequest(prompt="x", max_tokens=None, temperature=None, top_k=None)
    sp = req.to_sampling_params(default_max_tokens=77)
    assert (sp.max_tokens, sp.temperature, sp.top_k) == (77, 1.0, 0)


def test_completion_maps_fields() -> None:
    req = CompletionRequest(prompt="x", max_tokens=5, temperature=0, top_p=0.5, top_k=-1,
                            min_p=0.1, seed=3, stop="\n", stop_token_ids=[2], ignore_eos=True,
                            min_tokens=2, logprobs=3)
    sp = req.to_sampling_params(100)
    assert sp.max_tokens == 5 and sp.greedy and sp.top_p == 0.5 and sp.top_k == 0
    assert sp.min_p == 0.1 and sp.seed == 3 and sp.stop_strings == ["\n"]
    assert sp.stop_token_ids == [2] and sp.ignore_eos and sp.min_tokens == 2 and sp.logprobs == 3


def test_chat_default_max_tokens_is_passed_default() -> None:
    assert chat().to_sampling_params(default_max_tokens=123).max_tokens == 123


def test_chat_max_tokens_alias() -> None:
    assert chat(max_tokens=7).to_sampling_params(100).max_tokens == 7
    assert chat(max_completion_tokens=9).to_sampling_params(100).max_tokens == 9
    # The deprecated name loses when both are sent.
    both = chat(max_tokens=7, max_completion_tokens=9)
    assert both.to_sampling_params(100).max_tokens == 9


def test_chat_logprobs_mapping() -> None:
    assert chat().to_sampling_params(10).logprobs is None
    assert chat(logprobs=True).to_sampling_params(10).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).to_sampling_params(10).logprobs == 5


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
    ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]),
    # Past int64 (the engine's tensors): these used to fail the engine step, not the request.
    ("top_k", 1 << 64), ("seed", 1 << 63), ("seed", -(1 << 63) - 1),
    ("stop_token_ids", [1 << 64]),
])
def test_bad_sampling_values_raise_value_error(field: str, value: object) -> None:
    # Parsing succeeds; SamplingParams owns the ranges and the server maps its error to a 400.
    req = CompletionRequest(prompt="x", **{field: value})
    with pytest.raises(ValueError):
        req.to_sampling_params(16)
    with pytest.raises(ValueError):
        chat(**{field: value}).to_sampling_params(16)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        chat(min_tokens=5, max_completion_tokens=2).to_sampling_params(16)


# --- prompts and messages -----------------------------------------------------------------------


@pytest.mark.parametrize("prompt,expected", [
    ("a", ["a"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_normalisation(prompt: object, expected: list[object]) -> None:
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], 5, None, ["a", 1], [[1], "a"], [[]], [True], [1.5]])
def test_bad_prompts(prompt: object) -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest(prompt=prompt)
    msg, param = validation_error_message(ei.value)
    assert param == "prompt" and msg.startswith("prompt: ")
    assert ";" not in msg  # one error, not one per union arm


def test_prompt_required() -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest()
    assert validation_error_message(ei.value) == ("prompt: Field required", "prompt")


def test_message_dicts_flatten_text_parts() -> None:
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ])
    assert req.message_dicts() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
    assert req.add_generation_prompt is True


def test_message_dicts_keep_tool_fields_as_vllm() -> None:
    # vLLM's chat_utils: content null -> "" (the "string" content format), assistant tool_calls
    # with arguments decoded to objects, reasoning under both names, tool_call_id on tool
    # messages; fields on the wrong role are dropped.
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": '{"x":1,"y":[true,null]}'}}
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "go", "tool_call_id": "stray", "reasoning_content": "no"},
        {"role": "assistant", "content": None, "tool_calls": [call],
         "reasoning_content": "think"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}],
         "name": "f"},
        {"role": "assistant", "content": "done", "reasoning": "r", "reasoning_content": "old",
         "tool_calls": []},
    ])
    assert req.message_dicts() == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning": "think", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": {"x": 1, "y": [True, None]}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"},
        {"role": "assistant", "content": "done", "reasoning": "r", "reasoning_content": "r"},
    ]
    # The request itself is not modified: the arguments stay text in the model.
    assert req.messages[1].tool_calls == [call]


@pytest.mark.parametrize("arguments,expected", [
    ('{"a": "b"}', {"a": "b"}),
    ({"a": "b"}, {"a": "b"}),  # already an object (what transformers' docs use)
    ("", {}),
    (None, {}),
    ("not json", {}),  # vLLM: a warning, not an error (it sits in the history)
    ("[1, 2]", {}),  # valid JSON, but not an object
    ("42", {}),
])
def test_tool_call_arguments_as_vllm(arguments: object, expected: object) -> None:
    function: dict[str, object] = {"name": "f"}
    if arguments is not None:
        function["arguments"] = arguments
    req = ChatCompletionRequest(messages=[
        {"role": "assistant", "tool_calls": [{"id": "c", "function": function}]}])
    (call,) = req.message_dicts()[0]["tool_calls"]
    assert call == {"id": "c", "function": {"name": "f", "arguments": expected}}


@pytest.mark.parametrize("tool_calls,message", [
    ("x", "must be a list of tool calls"),
    ([1], "tool calls must be objects"),
    ([{"function": {"name": "f"}}], "string `id`"),
    ([{"id": "c", "type": "custom", "function": {"name": "f"}}], 'type "function"'),
    ([{"id": "c"}], "`function` object"),
    ([{"id": "c", "function": {"arguments": "{}"}}], "string `name`"),
    ([{"id": "c", "function": {"name": "f", "arguments": 3}}], "`arguments` must be a JSON"),
])
def test_bad_tool_calls_rejected(tool_calls: object, message: str) -> None:
    with pytest.raises(ValidationError) as ei:
        ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": tool_calls}])
    msg, param = validation_error_message(ei.value)
    assert msg.startswith("messages.0.tool_calls: ") and message in msg and param == "messages"


def test_template_kwargs() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    docs = [{"title": "t", "text": "x"}]
    req = chat(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False,
                                     "continue_final_message": True, "tools": "overridden"},
               tools=[tool], tool_choice="none", documents=docs)
    # The request's own fields win (as vLLM's build_chat_params merges them).
    assert req.template_kwargs() == {"enable_thinking": False, "tools": [tool],
                                     "documents": docs}
    assert req.add_generation_prompt and not req.continue_final_message
    assert req.tool_choice == "none"
    assert chat().template_kwargs() == {} and chat().tool_choice is None
    # Tools reach the template as sent: key order and extra keys kept.
    odd = {"function": {"parameters": {}, "name": "g", "strict": True}, "type": "function"}
    assert json.dumps(chat(tools=[odd], tool_choice="none").template_kwargs()["tools"]) == \
        json.dumps([odd])


@pytest.mark.parametrize("body,param,message", [
    ({"chat_template_kwargs": 1}, "chat_template_kwargs", "Input should be a valid dictionary"),
    ({"chat_template_kwargs": {"tokenize": False, "chat_template": None}},
     "chat_template_kwargs",
     "Found unexpected chat template kwargs from request: {'chat_template', 'tokenize'}"),
    ({"chat_template": "x"}, "chat_template", "untrusted chat template"),
    ({"continue_final_message": True}, "continue_final_message", "Cannot set both"),
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", '"function"'),
    ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools", "JSON schema"),
    ({"tools": [{"function": {"name": "f", "description": 1}}]}, "tools", "`description`"),
    ({"documents": [{"title": 1}]}, "documents", "valid string"),
    ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
])
def test_chat_template_field_errors(body: dict[str, object], param: str, message: str) -> None:
    for make in (chat, lambda **kw: TokenizeRequest(messages=USER, **kw)):
        if "tool_choice" in body and make is not chat:
            continue  # /tokenize has no tool_choice
        with pytest.raises(ValidationError) as ei:
            make(**body)
        msg, got_param = validation_error_message(ei.value)
        assert message in msg and got_param == param, (msg, got_param)


@pytest.mark.parametrize("tool_choice,message", [
    ({"type": "function", "function": {"name": "g"}}, "does not match any of the specified"),
    ({"type": "function", "function": "f"}, "Invalid value for `function`: `f`"),
    ({"type": "function", "function": {}}, "Expected field `name`"),
    ({"type": "function", "function": {"name": ""}}, "Invalid `name` in `function`"),
    ("any", "Invalid value for `tool_choice`: any!"),
])
def test_tool_choice_shapes(tool_choice: object, message: str) -> None:
    """Every choice of OpenAI's is taken ("auto" is vLLM's default with tools, and needs the
    server's tool-call parser: checked by the endpoint, tests/test_tool_calls.py); a malformed
    one is a 400 naming tool_choice, in vLLM's words."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools).tool_choice == "auto"
    for ok in ("none", "auto", "required", {"type": "function", "function": {"name": "f"}}):
        assert chat(tools=tools, tool_choice=ok).tool_choice == ok
    assert chat(tool_choice="none").tool_choice == "none"  # "none" needs no tools (vLLM)
    assert chat(tool_choice=None).tool_choice is None  # no tools: nothing to choose
    with pytest.raises(ValidationError) as ei:
        chat(tools=tools, tool_choice=tool_choice)
    msg, param = validation_error_message(ei.value)
    assert message in msg and param == "tool_choice", msg


def test_non_text_content_rejected() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    with pytest.raises(ValidationError) as ei:
        ChatCompletionRequest(messages=[{"role": "user", "content": [image]}])
    msg, param = validation_error_message(ei.value)
    assert msg == "messages.0.content: only text content is supported"
    assert param == "messages"


def test_empty_messages_rejected() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


# --- validators ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda **kw: CompletionRequest(prompt="x", **kw), chat])
def test_stream_options_need_stream(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=re.escape(STREAM_MSG)) as ei:
        make(stream_options={"include_usage": True})
    assert validation_error_message(ei.value) == (STREAM_MSG, "stream_options")
    ok = make(stream=True, stream_options={"include_usage": True})
    assert ok.include_usage
    assert not make(stream=True).include_usage
    assert make(stream_options=None).stream_options is None


def test_int64_edges_are_accepted() -> None:
    sp = CompletionRequest(prompt="x", seed=(1 << 63) - 1, top_k=(1 << 63) - 1,
                           priority=-(1 << 63)).to_sampling_params(16)
    assert sp.seed == (1 << 63) - 1 and sp.top_k == (1 << 63) - 1
    assert CompletionRequest(prompt="x", seed=-(1 << 63)).to_sampling_params(16).seed == -(1 << 63)


@pytest.mark.parametrize("field,value", [
    ("n", MAX_SEQUENCES + 1), ("priority", 1 << 63), ("priority", -(1 << 63) - 1),
    ("temperature", math.inf), ("top_p", math.nan), ("min_p", -math.inf),
])
def test_edge_fields_out_of_range_name_their_param(field: str, value: object) -> None:
    for make in (lambda **kw: CompletionRequest(prompt="x", **kw), chat):
        with pytest.raises(ValidationError) as ei:
            make(**{field: value})
        assert validation_error_message(ei.value)[1] == field


@pytest.mark.parametrize(("data", "found"), [
    ({"prompt": "ok \ud800"}, ("prompt", "\\ud800")),
    ({"prompt": ["fine", "\udc00x"]}, ("prompt.1", "\\udc00")),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     ("messages.0.content.0.text", "\\ud83d")),
    ({"x": {"\ud800": 1}}, ("x.\\ud800", "\\ud800")),  # a key; the path stays encodable
    ({"prompt": "\U0001F600 a valid pair", "stop": ["\u0000"]}, None),
    ({"deep": [[[[["\ud800"]]]]]}, ("deep.0.0.0.0.0", "\\ud800")),
])
def test_find_lone_surrogate(data: object, found: tuple[str, str] | None) -> None:
    assert find_lone_surrogate(data) == found


def test_lone_surrogates_are_rejected_everywhere() -> None:
    for make, kw in ((CompletionRequest, {"prompt": "a\ud800"}),
                     (CompletionRequest, {"prompt": "x", "stop": "\udfff"}),
                     (CompletionRequest, {"prompt": "x", "x_unknown": "\ud800"}),
                     (ChatCompletionRequest, {"messages": [{"role": "\ud800", "content": "x"}]}),
                     (TokenizeRequest, {"prompt": "\ud800"}),
                     (DetokenizeRequest, {"tokens": [1], "model": "\ud800"})):
        with pytest.raises(ValidationError) as ei:
            make(**kw)
        message, _ = validation_error_message(ei.value)
        assert "lone surrogate" in message
        message.encode("utf-8")  # the 400's body must itself be encodable


def test_error_body_escapes_what_utf8_cannot_carry() -> None:
    body = error_body("The model `\ud800` does not exist.", "NotFoundError", 404, "\udc00")
    assert body["error"]["message"] == "The model `\\ud800` does not exist."
    json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert error_body("héllo ✓")["error"]["message"] == "héllo ✓"


def test_token_count_bound_never_exceeds_the_count() -> None:
    from chunkserve.tokenizer.tokenizer import load_bundled_tokenizer
    from chunkserve.serve.openai.prompt_bound import TokenCountBound

    tok = load_bundled_tokenizer()
    bound = TokenCountBound(tok)
    assert 0 < bound.max_token_bytes < 200
    texts = ["x" * 5000, " " * 3000, "\u0000" * 999, "日本語" * 800, "<|im_start|>" * 200,
             "hello world " * 500, "=" * 4000, "\n" * 3000, "🙂" * 900, "a\u0301" * 900]
    for text in texts:
        assert bound.at_least(text) <= len(tok.encode(text, add_special_tokens=False))
    assert bound.at_least("x" * 1_000_000) > 10_000  # what lets the server refuse it at once

    class Other:  # not chunkserve's tokenizer: no bound, every prompt is tokenized
        pass

    assert TokenCountBound(Other()).at_least("x" * 1_000_000) == 0


@pytest.mark.parametrize("n", [0, -1])
def test_n_must_be_positive(n: int) -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest(prompt="x", n=n)
    assert validation_error_message(ei.value)[1] == "n"
    with pytest.raises(ValidationError):
        chat(n=n)
    assert CompletionRequest(prompt="x", n=3).n == 3


def test_completion_logprobs_bounds() -> None:
    assert CompletionRequest(prompt="x", logprobs=0).logprobs == 0
    assert CompletionRequest(prompt="x", logprobs=20).logprobs == 20
    for bad in (-1, 21):
        with pytest.raises(ValidationError) as ei:
            CompletionRequest(prompt="x", logprobs=bad)
        assert validation_error_message(ei.value)[1] == "logprobs"


def test_chat_top_logprobs_bounds_and_dependency() -> None:
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20
    for bad in (-1, 21):
        with pytest.raises(ValidationError):
            chat(logprobs=True, top_logprobs=bad)
    with pytest.raises(ValidationError, match="`logprobs` must be set to true") as ei:
        chat(top_logprobs=2)
    assert validation_error_message(ei.value)[1] == "top_logprobs"


def test_unknown_fields_accepted_and_listed() -> None:
    req = CompletionRequest(prompt="x", frequency_penalty=0.5, best_of=2, top_a=0.1, foo=1)
    assert req.unknown_fields() == ["foo", "top_a"]
    assert chat().unknown_fields() == []
    # Refused fields at their default, and fields that cannot change the output, are known.
    assert chat(response_format={"type": "text"}, parallel_tool_calls=True, store=False,
                use_beam_search=False).unknown_fields() == []
    # A field of the other endpoint is unknown here.
    assert chat(suffix=None).unknown_fields() == ["suffix"]
    # vLLM's chat template fields are known.
    known = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none",
                 chat_template_kwargs={"enable_thinking": False}, documents=[],
                 continue_final_message=False)
    assert known.unknown_fields() == []


def test_tokenize_requests() -> None:
    assert TokenizeRequest(prompt="hi").add_special_tokens is True
    req = TokenizeRequest(messages=USER, add_generation_prompt=False)
    assert req.message_dicts() == USER and req.add_generation_prompt is False
    # vLLM's chat template fields, as on chat requests.
    req = TokenizeRequest(messages=USER, tools=[{"function": {"name": "f"}}],
                          chat_template_kwargs={"enable_thinking": False})
    assert req.template_kwargs() == {"enable_thinking": False,
                                     "tools": [{"function": {"name": "f"}}]}
    for bad in ({}, {"prompt": "a", "messages": USER}):
        with pytest.raises(ValidationError, match="Exactly one"):
            TokenizeRequest(**bad)
    assert DetokenizeRequest(tokens=[1, 2]).tokens == [1, 2]
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=["a"])


# --- errors -------------------------------------------------------------------------------------


def test_error_body_shape() -> None:
    assert error_body("bad") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    body = error_body("nope", "NotFoundError", 404, param="model")
    assert body == {"error": {"message": "nope", "type": "NotFoundError", "param": "model",
                              "code": 404}}


def test_validation_message_for_bad_type() -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest(prompt="x", temperature="hot")
    msg, param = validation_error_message(ei.value)
    assert msg.startswith("temperature: Input should be a valid number") and param == "temperature"


def test_validation_message_from_fastapi() -> None:
    """Through a real FastAPI app: the `body` prefix is dropped and JSON errors stay readable."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_error_message(exc)
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest) -> dict[str, object]:
        return {"unknown": req.unknown_fields()}

    client = TestClient(app)
    r = client.post("/v1/completions", json={"prompt": "x", "top_k": "many"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "top_k" and err["message"].startswith("top_k: Input should be")
    assert err["type"] == "BadRequestError" and err["code"] == 400

    r = client.post("/v1/completions", json={"prompt": "x", "stream_options": {}})
    assert r.json()["error"] == {"message": STREAM_MSG, "type": "BadRequestError",
                                 "param": "stream_options", "code": 400}

    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("JSON decode error")

    r = client.post("/v1/completions")
    assert r.json()["error"]["message"] == "body: Field required"

    r = client.post("/v1/completions", json={"prompt": "x", "foo": 1})
    assert r.json() == {"unknown": ["foo"]}


# --- responses ----------------------------------------------------------------------------------


def test_ids() -> None:
    cid, chid = completion_id(), chat_completion_id()
    assert cid.startswith("cmpl-") and len(cid) > 10 and cid != completion_id()
    assert chid.startswith("chatcmpl-")
    int(cid.removeprefix("cmpl-"), 16)  # hex


def test_usage() -> None:
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_completion_shapes() -> None:
    choice = completion_choice(0, "hi", "length")
    assert choice == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}
    resp = completion_response("cmpl-1", "m", [choice], usage(1, 1))
    assert set(resp) == {"id", "object", "created", "model", "choices", "usage"}
    assert resp["object"] == "text_completion" and isinstance(resp["created"], int)
    assert resp["choices"] == [choice]
    chunk = completion_chunk("cmpl-1", "m", 1, "x", None, created=5)
    assert chunk == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                     "choices": [{"index": 1, "text": "x", "logprobs": None,
                                  "finish_reason": None}]}


def test_chat_shapes() -> None:
    choice = chat_choice(0, "hello", "stop")
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "hello"},
                      "logprobs": None, "finish_reason": "stop"}
    resp = chat_response("chatcmpl-1", "m", [choice], usage(2, 1))
    assert set(resp) == {"id", "object", "created", "model", "choices", "usage"}
    assert resp["object"] == "chat.completion"
    first = chat_chunk("chatcmpl-1", "m", 0, chat_delta("he", first=True), None, created=5)
    assert first == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                     "model": "m", "choices": [{"index": 0,
                                                "delta": {"role": "assistant", "content": "he"},
                                                "logprobs": None, "finish_reason": None}]}
    later = chat_chunk("chatcmpl-1", "m", 0, chat_delta("llo"), "stop")
    assert later["choices"][0]["delta"] == {"content": "llo"}
    assert later["choices"][0]["finish_reason"] == "stop"


def test_usage_chunk() -> None:
    u = usage(2, 3)
    chunk = usage_chunk("chatcmpl-1", "m", "chat.completion.chunk", u, created=1)
    assert chunk == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                     "model": "m", "choices": [], "usage": u}


# --- logprobs -----------------------------------------------------------------------------------

VOCAB = {1: "Hello", 2: " world", 3: "!", 4: " there", 5: "é"}


def render(token_id: int) -> str | None:
    return VOCAB.get(token_id)


def test_completion_logprobs() -> None:
    positions = [[(1, -0.1), (1, -0.1), (4, -2.0)], [(2, -0.5), (4, -0.3)]]
    lp = completion_logprobs(positions, render, text_offset=3)
    assert lp == {
        "tokens": ["Hello", " world"],
        "token_logprobs": [-0.1, -0.5],
        # The sampled token is always keyed, even when it is not among the top-k.
        "top_logprobs": [{"Hello": -0.1, " there": -2.0}, {" there": -0.3, " world": -0.5}],
        "text_offset": [3, 8],
    }


def test_completion_logprobs_edge_cases() -> None:
    # logprobs=0: only the sampled token; echoed first prompt token has no logprob;
    # unknown ids get vLLM's token_id:N spelling; -inf is clamped so the JSON stays valid.
    lp = completion_logprobs([[(3, None)], [(99, -math.inf)], [(2, -1.0)]], render)
    assert lp["tokens"] == ["!", "token_id:99", " world"]
    assert lp["token_logprobs"] == [None, -9999.0, -1.0]
    assert lp["top_logprobs"] == [None, {"token_id:99": -9999.0}, {" world": -1.0}]
    assert lp["text_offset"] == [0, 1, 12]
    json.dumps(lp, allow_nan=False)


def test_chat_logprobs() -> None:
    lp = chat_logprobs([[(5, -0.2), (5, -0.2), (3, -1.7)], [(2, -0.4)]], render)
    assert lp == {"content": [
        {"token": "é", "logprob": -0.2, "bytes": [0xC3, 0xA9], "top_logprobs": [
            {"token": "é", "logprob": -0.2, "bytes": [0xC3, 0xA9]},
            {"token": "!", "logprob": -1.7, "bytes": [33]},
        ]},
        {"token": " world", "logprob": -0.4, "bytes": list(b" world"), "top_logprobs": []},
    ]}
    assert set(lp["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    choice = chat_choice(0, "é world", "stop", logprobs=lp)
    json.dumps(choice, allow_nan=False)
