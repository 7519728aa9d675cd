"""No request field is silently ignored (issue 27): each one either changes the output as it
should, or is a 400 whose `param` names it.

Honoured: logit_bias, presence/frequency/repetition_penalty, best_of, echo with logprobs,
return_tokens_as_token_ids, add_special_tokens, chat_template_kwargs (also
tests/test_chat_request_fields.py). Refused unless sent with their default value: everything in
refused_fields.REFUSED_FIELDS (suffix, beam search, ...), and chat_template. Structured outputs
are served: their fields' checks are here too (tool calls: tests/test_tool_calls.py; "auto"
without a tool-call parser is a 400 here).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError
from server_utils import RemoteServer, assert_error

from chunkserve.serve.openai.chat_protocol import ChatCompletionRequest
from chunkserve.serve.http.errors import validation_error_message
from chunkserve.serve.openai.protocol import MAX_SEQUENCES, CompletionRequest
from chunkserve.serve.openai.refused_fields import REFUSED_FIELDS

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
PROMPT = "The quick brown fox jumps over the lazy dog."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
GREEDY = {"temperature": 0, "ignore_eos": True}

# A value that changes the output, for every refused field (a new entry in the table needs one).
REFUSED_VALUES: dict[str, Any] = {
    "suffix": "the end",
    "functions": [{"name": "f"}], "function_call": "auto", "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {}, "best_of": 2, "echo": True,
    "bad_words": ["fox"], "allowed_token_ids": [1, 2], "logits_processors": ["x.y"],
    "vllm_xargs": {"k": 1}, "truncate_prompt_tokens": 4, "use_beam_search": True,
    "length_penalty": 0.5, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "prompt_logprobs": 1, "return_token_ids": True,
    "stream_options.continuous_usage_stats": True,
}


def _endpoints(name: str) -> list[str]:
    where = REFUSED_FIELDS[name].endpoints
    return ["completions", "chat"] if where == "both" else [where]


def _body(endpoint: str, name: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = ({"prompt": PROMPT} if endpoint == "completions"
                            else {"messages": MESSAGES})
    head, _, tail = name.partition(".")
    if tail:  # a nested field
        body[head] = {tail: value}
        if head == "stream_options":
            body["stream"] = True
    else:
        body[name] = value
    return body


REFUSED_CASES = [(endpoint, name) for name in REFUSED_FIELDS for endpoint in _endpoints(name)]


# --- the table, without a server ----------------------------------------------------------------


def test_every_refused_field_has_a_test_value() -> None:
    assert set(REFUSED_VALUES) == set(REFUSED_FIELDS)


@pytest.mark.parametrize("endpoint,name", REFUSED_CASES)
def test_refused_fields_name_themselves(endpoint: str, name: str) -> None:
    make = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    param = name.split(".")[0]
    with pytest.raises(ValidationError) as ei:
        make(**_body(endpoint, name, REFUSED_VALUES[name]))
    message, got = validation_error_message(ei.value)
    assert got == param, message
    assert param in message, message
    # Its default value (each accepted one) changes nothing, so it is accepted, without a warning.
    for ok in REFUSED_FIELDS[name].accepted:
        req = make(**_body(endpoint, name, ok))
        assert param not in req.unknown_fields()


def test_logit_bias_mapping() -> None:
    sp = CompletionRequest(prompt="x", logit_bias={"5": 250, " 7": -1e9}).to_sampling_params(16)
    assert sp.logit_bias == {5: 100.0, 7: -100.0}  # vLLM's int(key), and clamped
    with pytest.raises(ValueError, match="logit_bias"):  # not an id: a 400 from SamplingParams
        CompletionRequest(prompt="x", logit_bias={"-1": 1}).to_sampling_params(16)
    for bad in ({"fox": 1}, {"1.5": 1}, {"": 2}):
        with pytest.raises(ValidationError) as ei:
            ChatCompletionRequest(messages=MESSAGES, logit_bias=bad)
        message, param = validation_error_message(ei.value)
        key = next(iter(bad))
        assert param == "logit_bias" and message == (
            f"logit_bias: Found token_id `{key}` in logit_bias but token_id must be an integer "
            "or string representing an integer")
    with pytest.raises(ValidationError) as ei:
        CompletionRequest(prompt="x", logit_bias={"5": "much"})
    assert validation_error_message(ei.value)[1] == "logit_bias"


def test_penalties_and_echo_mapping() -> None:
    req = CompletionRequest(prompt="x", presence_penalty=0.5, frequency_penalty=-1,
                            repetition_penalty=1.3, echo=True, logprobs=2)
    sp = req.to_sampling_params(16)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1, 1.3)
    assert sp.logprobs == 2 and sp.prompt_logprobs == 2
    sp = ChatCompletionRequest(messages=MESSAGES).to_sampling_params(16)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.prompt_logprobs is None and sp.logit_bias is None
    assert CompletionRequest(prompt="x", echo=True).to_sampling_params(16).prompt_logprobs is None
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3),
                         ("repetition_penalty", 0)):
        with pytest.raises(ValueError, match=field):  # SamplingParams' rule, a 400 upstream
            CompletionRequest(prompt="x", **{field: value}).to_sampling_params(16)


@pytest.mark.parametrize("body,message", [
    ({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n, got n=3 and best_of=2."),
    ({"best_of": 2, "temperature": 0}, "best_of must be 1 when using greedy sampling, got 2."),
    ({"best_of": 2, "stream": True}, "best_of=2 cannot be streamed"),
    ({"best_of": 0}, "greater than or equal to 1"),
    ({"best_of": MAX_SEQUENCES + 1}, "less than or equal to"),
])
def test_best_of_rules(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as ei:
        CompletionRequest(prompt="x", **body)
    got, param = validation_error_message(ei.value)
    assert message in got and param == "best_of", got


def test_best_of_mapping() -> None:
    req = CompletionRequest(prompt="x", n=2, best_of=3)
    assert req.samples_per_prompt == 3 and req.ranks_samples
    assert req.to_sampling_params(16).logprobs == 0  # for the ranking, not sent back
    assert CompletionRequest(prompt="x", n=2, best_of=3, logprobs=4).to_sampling_params(16) \
        .logprobs == 4
    same = CompletionRequest(prompt="x", n=2, best_of=2, stream=True, temperature=0.5)
    assert not same.ranks_samples and same.to_sampling_params(16).logprobs is None
    assert CompletionRequest(prompt="x", best_of=1, temperature=0).samples_per_prompt == 1


# --- through a server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_model_dir, ["--dtype", "float32", "--max-model-len", "256",
                                        "--served-model-name", "tiny"])
    yield srv
    srv.close()


def _complete(server: RemoteServer, **body: Any) -> dict[str, Any]:
    r = server.post("/v1/completions", {"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _token_ids(choice: dict[str, Any]) -> list[int]:
    """The sampled ids, from logprobs requested with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_server_refuses_each_field_by_name(server: RemoteServer) -> None:
    for endpoint, name in REFUSED_CASES:
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        r = server.post(path, _body(endpoint, name, REFUSED_VALUES[name]))
        assert_error(r, 400, "BadRequestError", param=name.split(".")[0])
    # vLLM's own messages where it has one.
    assert_error(server.post("/v1/completions", {"prompt": "x", "suffix": "!"}), 400,
                 message="suffix is not currently supported", param="suffix")
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS})
    assert_error(r, 400, message='"auto" tool choice requires --enable-auto-tool-choice and '
                 "--tool-call-parser to be set", param="tool_choice")
    # chat_template too (vLLM: untrusted unless --trust-request-chat-template).
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ 1 }}"})
    assert_error(r, 400, message="untrusted chat template", param="chat_template")
    r = server.post("/v1/chat/completions", {"messages": MESSAGES,
                                             "chat_template_kwargs": {"tokenize": True}})
    assert_error(r, 400, param="chat_template_kwargs")


def test_server_accepts_the_defaults(server: RemoteServer) -> None:
    defaults = {"response_format": {"type": "text"}, "use_beam_search": False,
                "length_penalty": 1.0, "skip_special_tokens": True, "suffix": None,
                "stream": True, "stream_options": {"continuous_usage_stats": False}}
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **defaults})
    assert r.status_code == 200, r.text
    # tools with tool_choice "none": rendered into the prompt, the reply is text.
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                                             "tool_choice": "none", "max_tokens": 2,
                                             "modalities": ["text"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_logit_bias_is_honoured(server: RemoteServer) -> None:
    ids = server.post("/tokenize", {"prompt": " fox", "add_special_tokens": False}) \
        .json()["tokens"]
    (fox,) = ids
    plain = _complete(server, max_tokens=4, logprobs=0, return_tokens_as_token_ids=True,
                      **GREEDY)["choices"][0]
    assert _token_ids(plain) != [fox] * 4
    biased = _complete(server, max_tokens=4, logprobs=0, return_tokens_as_token_ids=True,
                       logit_bias={str(fox): 100}, **GREEDY)["choices"][0]
    assert _token_ids(biased) == [fox] * 4 and biased["text"] == " fox" * 4
    # Chat too, and a bias far past OpenAI's bound is clamped, not refused.
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3,
                                             "logit_bias": {str(fox): 1e6}, **GREEDY})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " fox" * 3
    # Ids outside the vocabulary and keys that are not ids name the field.
    for bias, message in (({"100000000": 5}, "out-of-vocab"), ({"-1": 5}, "token ids"),
                          ({"fox": 5}, "Found token_id `fox` in logit_bias")):
        r = server.post("/v1/completions", {"prompt": PROMPT, "logit_bias": bias})
        assert_error(r, 400, "BadRequestError", message, "logit_bias")


def test_penalties_are_honoured(server: RemoteServer) -> None:
    def ids(**extra: Any) -> list[int]:
        return _token_ids(_complete(server, max_tokens=16, logprobs=0,
                                    return_tokens_as_token_ids=True, **GREEDY,
                                    **extra)["choices"][0])

    plain = ids()
    assert len(set(plain)) < len(plain), "greedy output must repeat a token for this test"
    for field, value in (("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                         ("repetition_penalty", 3.0)):
        penalized = ids(**{field: value})
        assert penalized != plain and len(set(penalized)) == len(penalized), field
    assert ids(presence_penalty=0, frequency_penalty=0, repetition_penalty=1) == plain
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -2.5),
                         ("repetition_penalty", 0)):
        r = server.post("/v1/chat/completions", {"messages": MESSAGES, field: value})
        assert_error(r, 400, "BadRequestError", field, field)


def test_best_of_returns_the_n_most_likely(server: RemoteServer) -> None:
    common = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True,
              "logprobs": 0}
    # Sample j of a seeded request uses seed + j, so n=4 shows the four samples best_of=4 draws.
    four = _complete(server, n=4, **common)["choices"]

    def score(choice: dict[str, Any]) -> float:
        return sum(choice["logprobs"]["token_logprobs"])

    best = sorted(four, key=score, reverse=True)[:2]
    r = _complete(server, n=2, best_of=4, **common)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [c["text"] for c in best]
    assert r["usage"]["completion_tokens"] == 4 * 5  # every sample is billed, as OpenAI does
    # Without logprobs asked, none come back (the ranking's are internal).
    no_lp = _complete(server, **{**common, "logprobs": None}, n=1, best_of=4,
                      prompt=[PROMPT, "Hello there"])
    assert [c["index"] for c in no_lp["choices"]] == [0, 1]
    assert no_lp["choices"][0]["text"] == best[0]["text"]
    assert all(c["logprobs"] is None for c in no_lp["choices"])
    assert no_lp["usage"]["completion_tokens"] == 2 * 4 * 5
    # Over the sequence cap: named as best_of.
    r = server.post("/v1/completions", {"prompt": [PROMPT, PROMPT], "best_of": MAX_SEQUENCES,
                                        "n": 1})
    assert_error(r, 400, "BadRequestError", f"best_of={MAX_SEQUENCES}", "best_of")
    r = server.post("/v1/completions", {"prompt": PROMPT, "best_of": 2, "stream": True})
    assert_error(r, 400, "BadRequestError", "cannot be streamed", "best_of")


def test_echo_with_logprobs(server: RemoteServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 2, **GREEDY}
    r = server.post("/v1/completions", body).json()
    choice, num_prompt = r["choices"][0], r["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    plain = _complete(server, max_tokens=3, logprobs=2, **GREEDY)["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == num_prompt + 3
    # The first prompt token has no logprob; every later one does, with its top 2 (+ itself).
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:num_prompt]) == PROMPT
    assert lp["text_offset"][0] == 0 and lp["text_offset"][num_prompt] == len(PROMPT)
    # The generated part is what the same request without echo returns.
    assert lp["tokens"][num_prompt:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][num_prompt:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    # Streamed: the echoed prompt and its logprobs come first, then the same tokens.
    with server.http() as http, http.stream("POST", "/v1/completions",
                                            json={**body, "stream": True}) as resp:
        events = [json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and len(first["logprobs"]["tokens"]) == num_prompt
    got: dict[str, list[Any]] = {k: [] for k in lp}
    for event in events:
        for key in got:
            got[key] += event["choices"][0]["logprobs"][key]
    assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
    assert got["token_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:])


def test_structured_outputs_on_the_server(server: RemoteServer) -> None:
    """Every way a client asks for structured output reaches the grammar (the tiny random
    model: only the constraint makes its output readable); a bad constraint is a 400."""
    def text(path: str, body: dict[str, Any]) -> str:
        r = server.post(path, {"max_tokens": 40, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        return choice["text"] if "text" in choice else choice["message"]["content"]

    assert text("/v1/completions", {"prompt": PROMPT, "guided_choice": ["yes", "no"]}) \
        in ("yes", "no")
    assert text("/v1/completions", {"prompt": PROMPT, "structured_outputs":
                                    {"regex": r"[0-9]{3}"}}).isdigit()
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    got = text("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "flag", "schema": flag}}})
    assert isinstance(json.loads(got)["ok"], bool)
    assert text("/v1/completions", {"prompt": PROMPT, "guided_json": flag}).startswith("{")

    bad = [({"guided_json": {"type": "objectx"}}, "JSON schema is invalid", None),
           ({"guided_regex": "[a-"}, "regex is invalid", None),
           ({"guided_json": {"type": "string", "format": "weird"}}, "Unknown format", None),
           ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output",
            "guided_choice"),
           ({"response_format": {"type": "xml"}}, "response_format type", "response_format"),
           ({"structured_outputs": {"lark": "start: 'a'"}}, "unsupported key",
            "structured_outputs"),
           ({"guided_choice": []}, "non-empty list", "guided_choice")]
    for fields, message, param in bad:
        r = server.post("/v1/completions", {"prompt": PROMPT, **fields})
        assert_error(r, 400, message=message, param=param)
    # json_schema's strict: a keyword the grammar cannot enforce is a 400 only when strict.
    loose = {**flag, "dependentRequired": {"ok": ["why"]}}
    for strict in (True, False):
        r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40,
                                                 "temperature": 0, "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "flag", "schema": loose, "strict": strict}}})
        if strict:
            assert_error(r, 400, message="dependentRequired")
        else:
            assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["ok"],
                              bool)


def test_the_openai_client_parses_a_pydantic_model(server: RemoteServer) -> None:
    """The official client's structured parse: it sends the model's JSON schema (strict) as
    response_format and parses the reply into the model."""
    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        ok: bool
        score: int = Field(ge=0, le=9)  # bounded: a random model's digits end

    parse = server.client().chat.completions.parse
    r = parse(model="tiny", messages=MESSAGES, response_format=Verdict, max_tokens=40,
              temperature=0)
    verdict = r.choices[0].message.parsed
    assert isinstance(verdict, Verdict), r.choices[0].message.content
