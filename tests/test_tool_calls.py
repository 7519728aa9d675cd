"""Tool calls on /v1/chat/completions (issue 31; serve/openai/tools/tool_choice.py, serve/openai/tools/parsers.py).

A named tool_choice and "required" are grammar-constrained, so even the tiny random model's
arguments parse and validate; "auto" is read by the server's --tool-call-parser. A stream's
deltas add up to the same calls as the whole response; bad input is a 400 (or a CLI error for
the server's flags).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import RemoteServer, assert_error

from chunkserve.cli import main
from chunkserve.serve.openai.tools.tool_choice import ToolCallReader, tool_choice_constraint
from chunkserve.serve.openai.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedFunctionParser,
    RequiredParser,
    ToolCallParser,
)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The same outputs whatever the parser sees them as: (parser, text, content, [(name, args)]).
CASES: list[tuple[ToolCallParser, str, str | None, list[tuple[str, str]]]] = [
    (HermesParser(), 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 12}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {}}\n</tool_call>', "Let me look.\n",
     [("get_weather", '{"city": "Paris", "days": 12}'), ("get_time", "{}")]),
    (HermesParser(), "No call, only <tool talk> and <tool_", "No call, only <tool talk> and "
     "<tool_", []),
    (Llama3JsonParser(), '<|python_tag|>{"name": "f", "parameters": {"a": [1, "}"]}}; '
     '{"name": "g", "parameters": {}}', None, [("f", '{"a": [1, "}"]}'), ("g", "{}")]),
    (Llama3JsonParser(), "  The answer is 4.", "  The answer is 4.", []),
    (RequiredParser(), '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]', None,
     [("f", '{"a":1}'), ("g", "{}")]),
    (NamedFunctionParser("f"), '{"a": {"b": 2}}', None, [("f", '{"a": {"b": 2}}')]),
]
# A call cut off (max_tokens) is no call: the whole reply is content, as vLLM answers. A stream
# has sent the call's start by then, and cannot take it back (nor can vLLM's).
CUT_OFF = (HermesParser(), '<tool_call>{"name": "f", "arguments": {"a": 1',
           '<tool_call>{"name": "f", "arguments": {"a": 1', [])


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], Any]:
    """The content and calls a stream of `pieces` adds up to, and its finish_reason."""
    reader = ToolCallReader(parser)
    deltas = [reader.delta(piece, False, None)[0] for piece in pieces]
    last, reason = reader.delta("", True, "stop")
    return _assemble([*deltas, last]) + (reason,)


def _assemble(deltas: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call's first delta: its id, type and name
                assert call["type"] == "function" and call["index"] not in calls
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]  # type: ignore[misc]


@pytest.mark.parametrize("parser,text,content,calls", [*CASES, CUT_OFF])
def test_parsers_read_whole_replies(parser: ToolCallParser, text: str, content: str | None,
                                    calls: list[tuple[str, str]]) -> None:
    got_content, got_calls, reason = ToolCallReader(parser).message(text, "stop")
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") for c in got_calls)
    named = isinstance(parser, NamedFunctionParser)
    assert reason == ("tool_calls" if calls and not named else "stop")  # OpenAI's rule


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_stream_adds_up_to_the_whole_reply(case: Any, cuts: list[int]) -> None:
    parser, text, content, calls = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got_content, got_calls, _ = _streamed(parser, pieces)
    assert (got_content, got_calls) == (content or "", calls)


def test_parallel_tool_calls_false_keeps_one_call() -> None:
    text = CASES[0][1]
    _, calls, _ = ToolCallReader(HermesParser(), parallel_tool_calls=False).message(text, "stop")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    schema = tool_choice_constraint(TOOLS, "required", parallel_tool_calls=False).json
    assert schema["maxItems"] == 1  # type: ignore[index]


def test_required_schema_takes_every_tool_and_lifts_defs() -> None:
    point = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
             "$defs": {"P": {"type": "integer"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "move", "parameters": point}}]
    schema = tool_choice_constraint(tools, "required").json
    assert isinstance(schema, dict) and schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "move", "parameters": {"p": 3}},
                         {"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)  # at least one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"p": "x"}}], schema)
    assert tool_choice_constraint(TOOLS, "auto") is None
    assert tool_choice_constraint(TOOLS, {"type": "function", "function": {
        "name": "get_time"}}).json == TIME  # type: ignore[union-attr]


# ---- on the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_model_dir, ["--dtype", "float32", "--max-model-len", "512",
                                        "--served-model-name", "tiny",
                                        "--enable-auto-tool-choice",
                                        "--tool-call-parser", "hermes"])
    yield srv
    srv.close()


def _chat(server: RemoteServer, **body: Any) -> dict[str, Any]:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                                             "max_tokens": 80, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _chat_stream(server: RemoteServer, **body: Any) -> tuple[str, list[tuple[str, str]], str]:
    payload = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "temperature": 0,
               "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload,
                      timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events]
    content, calls = _assemble([c["delta"] for c in choices])
    return content, calls, choices[-1]["finish_reason"]


def _calls(choice: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls", [])]


def test_a_named_tool_choice_always_returns_parseable_arguments(server: RemoteServer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2, 3):  # sampled: the grammar, not luck, makes the arguments parse
        choice = _chat(server, tool_choice=named, temperature=1.0, seed=seed)
        (name, arguments), = _calls(choice)
        assert name == "get_weather" and choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(arguments), WEATHER)
        assert choice["message"]["content"] is None
    whole = _chat(server, tool_choice=named)
    assert _chat_stream(server, tool_choice=named) == ("", _calls(whole), "stop")


def test_required_calls_known_tools_and_streams_the_same(server: RemoteServer) -> None:
    whole = _chat(server, tool_choice="required", max_tokens=120)
    assert whole["finish_reason"] == "tool_calls", whole
    calls = _calls(whole)
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert _chat_stream(server, tool_choice="required", max_tokens=120) == (
        "", calls, "tool_calls")


def test_auto_reads_the_hermes_parsers_calls(server: RemoteServer) -> None:
    """The random model is made to write a Hermes call (a regex); the parser reads it out."""
    written = (r'Checking\.\n<tool_call>\n\{"name": "get_time", "arguments": '
               r'\{"zone": "(UTC|CET)"\}\}\n</tool_call>')
    whole = _chat(server, tool_choice="auto", guided_regex=written)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Checking.\n"
    (name, arguments), = _calls(whole)
    assert name == "get_time" and json.loads(arguments)["zone"] in ("UTC", "CET")
    assert _chat_stream(server, guided_regex=written) == ("Checking.\n", _calls(whole),
                                                         "tool_calls")
    plain = _chat(server, tool_choice="auto", max_tokens=5)  # no call: text, as it came
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "length"


def test_the_openai_client_gets_tool_calls(server: RemoteServer) -> None:
    r = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_bad_tool_requests_are_400s(server: RemoteServer) -> None:
    missing = {"type": "function", "function": {"name": "book_flight"}}
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                                             "tool_choice": missing})
    assert_error(r, 400, message="does not match any of the specified `tools`",
                 param="tool_choice")
    r = server.post("/v1/chat/completions", {
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert_error(r, 400, message="cannot be combined", param="tool_choice")
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": bad_schema,
                                             "tool_choice": "required"})
    assert_error(r, 400, message="JSON schema is invalid")
    # A tool's strict: a keyword its grammar cannot enforce is a 400 only when strict.
    loose = {**TIME, "dependentRequired": {"zone": ["date"]}}
    for strict in (True, False):
        tools = [{"type": "function", "function": {"name": "t", "parameters": loose,
                                                   "strict": strict}}]
        # Greedy, with room for the call (as the tests above): sampled, the tiny model's call
        # under a loose schema sometimes ran past 60 tokens, and a call cut off is no call.
        r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": tools,
                                                 "tool_choice": "required", "max_tokens": 120,
                                                 "temperature": 0})
        if strict:
            assert_error(r, 400, message="dependentRequired")
        else:
            assert r.json()["choices"][0]["message"]["tool_calls"], r.text
    tools = [{"type": "function", "function": {"name": "t", "strict": "yes"}}]
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": tools})
    assert_error(r, 400, message="`strict` must be a boolean", param="tools")


def test_the_servers_tool_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
