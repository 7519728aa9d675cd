"""What a chat request gives its chat template, as vLLM gives it: `chat_template_kwargs`,
`tools`, `documents`, `add_generation_prompt`, `continue_final_message`, and messages that keep
their `tool_calls`, `tool_call_id` and reasoning.

Checked against transformers' `apply_chat_template` on real templates (Qwen3, Mistral Nemo;
copies in tests/data/chat_templates): first the prompt builder alone, then end to end through a
server whose model (the tiny random Llama) carries Qwen3's template, reading the prompt back
with /tokenize + /detokenize and the chat endpoint's `usage.prompt_tokens`.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import pytest
from server_utils import RemoteServer, assert_error
from test_chat_templates import (  # noqa: F401 - hf_folders is a fixture used here
    MISTRAL_NEMO,
    QWEN3,
    TOOLS,
    WEATHER_TOOL,
    hf_folders,
    load_template,
)

from chunkserve.serve.openai.chat_prompt import render_chat_prompt
from chunkserve.tokenizer.chat_template import template_variables
from chunkserve.serve.openai.chat_protocol import ChatCompletionRequest
from chunkserve.tokenizer.tokenizer import Tokenizer

NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
USER_ONLY = [{"role": "user", "content": "Hello!"}]

# A tool conversation as OpenAI clients send it: `content: null` beside tool_calls, arguments as
# JSON text (compact, so the re-serialization of the decoded object shows), tool results as
# content parts, reasoning under vLLM's two names.
WIRE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two tools at once.",
     "tool_calls": [
         {"id": "call0abcd", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city":"Zürich","unit":"celsius"}'}},
         {"id": "call1efgh", "type": "function",
          "function": {"name": "get_time", "arguments": '{"city": "Zürich"}'}},
     ]},
    {"role": "tool", "tool_call_id": "call0abcd",
     "content": [{"type": "text", "text": '{"temp": 21, "sky": "<sunny>"}'}]},
    {"role": "tool", "tool_call_id": "call1efgh", "content": "14:05"},
    {"role": "assistant", "content": "21 °C and sunny; it is 14:05.", "reasoning": "Done."},
    {"role": "user", "content": "Thanks!"},
]
# The same conversation as vLLM hands it to transformers (chat_utils: content "" for null,
# arguments decoded to objects, text parts joined, reasoning under both names).
TEMPLATE_CONVERSATION: list[dict[str, Any]] = [
    WIRE_CONVERSATION[0],
    WIRE_CONVERSATION[1],
    {"role": "assistant", "content": "", "reasoning": "Two tools at once.",
     "reasoning_content": "Two tools at once.",
     "tool_calls": [
         {"id": "call0abcd", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}},
         {"id": "call1efgh", "type": "function",
          "function": {"name": "get_time", "arguments": {"city": "Zürich"}}},
     ]},
    {"role": "tool", "tool_call_id": "call0abcd", "content": '{"temp": 21, "sky": "<sunny>"}'},
    WIRE_CONVERSATION[4],
    {"role": "assistant", "content": "21 °C and sunny; it is 14:05.", "reasoning": "Done.",
     "reasoning_content": "Done."},
    WIRE_CONVERSATION[6],
]


class _Pair:
    """chunkserve's Tokenizer and transformers' for one folder."""

    def __init__(self, folder: Path) -> None:
        from transformers import PreTrainedTokenizerFast

        self.ours = Tokenizer.from_hf_dir(str(folder))
        self.ref = PreTrainedTokenizerFast.from_pretrained(str(folder))
        assert self.ours.chat_template == self.ref.chat_template is not None

    def ref_render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        kwargs.setdefault("add_generation_prompt", True)
        return self.ref.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)

    def render(self, **body: Any) -> str:
        """The prompt the server builds for a chat request body (with tools, tool_choice "none",
        the only one served: the prompt is the same whatever the choice)."""
        if "tools" in body:
            body.setdefault("tool_choice", "none")
        req = ChatCompletionRequest(**body)
        return render_chat_prompt(self.ours, req.message_dicts(), req.add_generation_prompt,
                                  req.continue_final_message, req.template_kwargs())


@pytest.fixture(scope="module")
def qwen3(hf_folders: dict[str, Path]) -> _Pair:
    return _Pair(hf_folders[QWEN3])


@pytest.fixture(scope="module")
def nemo(hf_folders: dict[str, Path]) -> _Pair:
    return _Pair(hf_folders[MISTRAL_NEMO])


# --- the prompt builder against transformers ---------------------------------------------------


def test_enable_thinking_reaches_qwen3(qwen3: _Pair) -> None:
    off = qwen3.render(messages=USER_ONLY, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith(NO_THINK)
    assert off == qwen3.ref_render(USER_ONLY, enable_thinking=False)
    on = qwen3.render(messages=USER_ONLY, chat_template_kwargs={"enable_thinking": True})
    assert on == qwen3.render(messages=USER_ONLY) == qwen3.ref_render(USER_ONLY)
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"


def test_kwargs_the_template_does_not_read_are_harmless(qwen3: _Pair) -> None:
    assert "nonsense" not in (template_variables(qwen3.ours.chat_template) or ())
    # Not passed at all (as vLLM filters them), so not even a name the renderer's own signature
    # uses can collide.
    # A global the template calls is not one of its variables either (vLLM's filter, jinja2's
    # find_undeclared_variables, leaves it out too).
    for junk in ({"nonsense": [1, {"a": None}]}, {"template": "x", "self": 1},
                 {"namespace": 3}):
        assert qwen3.render(messages=USER_ONLY, chat_template_kwargs=junk) == \
            qwen3.ref_render(USER_ONLY)


def test_template_variables() -> None:
    # What vLLM's resolve_chat_template_kwargs reads: names a template uses without setting
    # them, through transformers' {% generation %} tag and loop controls.
    template = ("{% set n = 1 %}{% for m in messages %}{% generation %}{{ m.content }}{{ foo }}"
                "{{ n }}{% endgeneration %}{% if bar %}{% break %}{% endif %}{% endfor %}")
    assert template_variables(template) == {"messages", "foo", "bar"}
    assert template_variables("{% if %}") is None  # rendering reports the syntax error


def test_request_fields_win_over_chat_template_kwargs(qwen3: _Pair) -> None:
    # As vLLM's build_chat_params: add_generation_prompt / continue_final_message come from
    # the request, tools from the request when it has them.
    kw = {"add_generation_prompt": False, "enable_thinking": False, "tools": [WEATHER_TOOL]}
    got = qwen3.render(messages=USER_ONLY, tools=TOOLS, chat_template_kwargs=kw)
    assert got == qwen3.ref_render(USER_ONLY, tools=TOOLS, enable_thinking=False)
    assert got.endswith(NO_THINK) and '"get_time"' in got
    # Without `tools` on the request, the kwarg's tools are used (vLLM passes them through).
    got = qwen3.render(messages=USER_ONLY, chat_template_kwargs={"tools": [WEATHER_TOOL]})
    assert got == qwen3.ref_render(USER_ONLY, tools=[WEATHER_TOOL])


def test_tools_reach_the_prompt(qwen3: _Pair) -> None:
    got = qwen3.render(messages=USER_ONLY, tools=TOOLS, tool_choice="none")
    assert got == qwen3.ref_render(USER_ONLY, tools=TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n" in got


def test_tool_conversation_renders_like_transformers(qwen3: _Pair, nemo: _Pair) -> None:
    got = qwen3.render(messages=WIRE_CONVERSATION, tools=TOOLS)
    assert got == qwen3.ref_render(TEMPLATE_CONVERSATION, tools=TOOLS)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
            '"unit": "celsius"}}\n</tool_call>') in got
    assert "<tool_response>\n{\"temp\": 21, \"sky\": \"<sunny>\"}\n</tool_response>" in got
    # The turn still in progress (tool results last), thinking off.
    pending = WIRE_CONVERSATION[:5]
    got = qwen3.render(messages=pending, tools=TOOLS,
                       chat_template_kwargs={"enable_thinking": False})
    assert got == qwen3.ref_render(TEMPLATE_CONVERSATION[:5], tools=TOOLS, enable_thinking=False)
    assert "<think>\nTwo tools at once.\n</think>" in got  # the reasoning field reached it
    # Mistral's format: [AVAILABLE_TOOLS], [TOOL_CALLS] with the ids, [TOOL_RESULTS].
    got = nemo.render(messages=WIRE_CONVERSATION, tools=TOOLS)
    assert got == nemo.ref_render(TEMPLATE_CONVERSATION, tools=TOOLS)
    assert '"id": "call0abcd"' in got and "[TOOL_RESULTS]" in got


def test_continue_final_message_like_transformers(qwen3: _Pair) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "The answer is "}]
    got = qwen3.render(messages=messages, add_generation_prompt=False,
                       continue_final_message=True)
    assert got == qwen3.ref_render(messages, add_generation_prompt=False,
                                   continue_final_message=True)
    # Open, and its trailing space kept (the template keeps the message's spacing).
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is ")
    closed = qwen3.render(messages=messages, add_generation_prompt=False)
    assert closed.endswith("The answer is <|im_end|>\n")
    # A template that trims the content: the cut falls before the trimmed space, as in
    # transformers.
    trimming = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>"
                "{% endfor %}")
    ours = Tokenizer(qwen3.ours.hf_tokenizer, bos_token_id=None, eos_token_id=None,
                     add_bos=False, chat_template=trimming)
    got = render_chat_prompt(ours, messages, False, True)
    assert got == qwen3.ref.apply_chat_template(messages, tokenize=False, chat_template=trimming,
                                                continue_final_message=True)
    assert got.endswith("<assistant>The answer is")


def test_documents_reach_the_template(qwen3: _Pair) -> None:
    template = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    ours = Tokenizer(qwen3.ours.hf_tokenizer, bos_token_id=None, eos_token_id=None,
                     add_bos=False, chat_template=template)
    docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    req = ChatCompletionRequest(messages=USER_ONLY, documents=docs)
    got = render_chat_prompt(ours, req.message_dicts(), True, False, req.template_kwargs())
    assert got == qwen3.ref.apply_chat_template(USER_ONLY, documents=docs, tokenize=False,
                                                chat_template=template)
    assert got == "[A] alpha\n[B] beta\nuser: Hello!\n"


# --- end to end: a server whose model carries Qwen3's template ---------------------------------


@pytest.fixture(scope="module")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-template") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = load_template(QWEN3)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def server(qwen3_model_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(str(qwen3_model_dir), ["--dtype", "float32", "--max-model-len", "512",
                                              "--served-model-name", "tiny-qwen3"])
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def ref(qwen3_model_dir: Path) -> _Pair:
    return _Pair(qwen3_model_dir)


def _prompt(server: RemoteServer, body: dict[str, Any]) -> tuple[str, int]:
    """The prompt text /tokenize builds for a chat body, and its token count."""
    r = server.post("/tokenize", body)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    text = server.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    return text, len(tokens)


def _chat_prompt_tokens(server: RemoteServer, body: dict[str, Any]) -> int:
    r = server.post("/v1/chat/completions", {**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_server_enable_thinking(server: RemoteServer, ref: _Pair) -> None:
    body = {"messages": USER_ONLY, "chat_template_kwargs": {"enable_thinking": False}}
    text, count = _prompt(server, body)
    assert text.endswith(NO_THINK) and text == ref.ref_render(USER_ONLY, enable_thinking=False)
    assert _chat_prompt_tokens(server, body) == count
    # And through the official client, where it travels in extra_body.
    r = server.client().chat.completions.create(
        model="tiny-qwen3", messages=USER_ONLY, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == count
    assert count > _prompt(server, {"messages": USER_ONLY})[1]


def test_server_tool_conversation(server: RemoteServer, ref: _Pair) -> None:
    body = {"messages": WIRE_CONVERSATION, "tools": TOOLS}
    text, count = _prompt(server, body)
    assert text == ref.ref_render(TEMPLATE_CONVERSATION, tools=TOOLS)
    assert "<tools>" in text and '"name": "get_time"' in text
    assert _chat_prompt_tokens(server, {**body, "tool_choice": "none"}) == count
    r = server.client().chat.completions.create(model="tiny-qwen3", messages=WIRE_CONVERSATION,
                                                tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens == count


def test_server_continue_final_message(server: RemoteServer, ref: _Pair) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "The answer is "}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    text, count = _prompt(server, body)
    assert text == ref.ref_render(messages, add_generation_prompt=False,
                                  continue_final_message=True)
    assert _chat_prompt_tokens(server, body) == count


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("extra,param,message", [
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs",
     "valid dictionary"),
    ({"chat_template_kwargs": [{"enable_thinking": False}]}, "chat_template_kwargs",
     "valid dictionary"),
    ({"continue_final_message": True}, "continue_final_message",
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "Cannot set both"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "untrusted chat template"),
    ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs",
     "untrusted chat template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "Found unexpected chat template kwargs from request: {'tokenize'}"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "`messages`"),
    ({"tools": []}, "tools", "`tools` must not be an empty array"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "`name`"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages", "`id`"),
])
def test_server_bad_template_fields_are_400(server: RemoteServer, path: str,
                                            extra: dict[str, Any], param: str,
                                            message: str) -> None:
    assert_error(server.post(path, {"messages": USER_ONLY, **extra}), 400, "BadRequestError",
                 message, param)


@pytest.mark.parametrize("tool_choice,message", [
    # No tool_choice with tools means "auto" (vLLM's default), which needs a parser.
    (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ({"type": "function", "function": {"name": "nope"}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ("sometimes", "Invalid value for `tool_choice`: sometimes!"),
])
def test_server_tool_choice_without_a_parser_is_400(server: RemoteServer, tool_choice: Any,
                                                    message: str) -> None:
    """This server has no --tool-call-parser: "auto" is refused ("required" and named choices
    need none: tests/test_tool_calls.py)."""
    body = {"messages": USER_ONLY, "tools": TOOLS}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    assert_error(server.post("/v1/chat/completions", body), 400, "BadRequestError", message,
                 "tool_choice")
    assert_error(server.post("/v1/chat/completions", {"messages": USER_ONLY,
                                                      "tool_choice": "auto"}),
                 400, "BadRequestError", "When using `tool_choice`, `tools` must be set.",
                 "tool_choice")


def test_server_template_errors_are_400(server: RemoteServer) -> None:
    # Values from chat_template_kwargs that the renderer or the template cannot use: the
    # request's fault whatever the exception (a ValueError, or a TypeError from iterating a
    # number), so a 400, and the server carries on.
    for tools, detail in (([1], "tools must be JSON schemas"), (5, "TypeError")):
        r = server.post("/v1/chat/completions", {"messages": USER_ONLY, "max_tokens": 1,
                                                 "chat_template_kwargs": {"tools": tools}})
        err = assert_error(r, 400, "BadRequestError", "The chat template could not format",
                           "messages")
        assert detail in err["message"]
    assert _chat_prompt_tokens(server, {"messages": USER_ONLY}) > 0
