"""Real chat templates (Qwen2.5, Qwen3, Phi-3, Mistral; copies in tests/data/chat_templates, see
its README) rendered by chunkserve and by transformers, compared byte for byte.

Two paths: `render_chat_template` against transformers' `render_jinja_template`, and chunkserve's
`Tokenizer` built from a HF folder written here against transformers' tokenizer for the same
folder (`apply_chat_template(..., tokenize=False)`). Offline: nothing comes from a hub.
"""
from __future__ import annotations

import gzip
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import jinja2
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.tokenizer.chat_template import render_chat_template
from chunkserve.tokenizer.tokenizer import BUNDLED_TOKENIZER_DIR, Tokenizer

TEMPLATE_DIR = Path(__file__).parent / "data" / "chat_templates"

QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
QWEN3 = "Qwen-Qwen3-0.6B"
PHI3 = "microsoft-Phi-3-mini-4k-instruct"
PHI35 = "microsoft-Phi-3.5-mini-instruct"
MISTRAL_NEMO = "mistralai-Mistral-Nemo-Instruct-2407"
MIXTRAL = "mistralai-Mixtral-8x7B-Instruct-v0.1"

# The special tokens each model's tokenizer_config.json gives (None: the model has none). The
# templates read bos_token / eos_token; Qwen has no BOS.
SPECIAL_TOKENS: dict[str, dict[str, str | None]] = {
    QWEN25: {"bos_token": None, "eos_token": "<|im_end|>"},
    QWEN3: {"bos_token": None, "eos_token": "<|im_end|>"},
    PHI3: {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    PHI35: {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    MISTRAL_NEMO: {"bos_token": "<s>", "eos_token": "</s>"},
    MIXTRAL: {"bos_token": "<s>", "eos_token": "</s>"},
}


def load_template(name: str) -> str:
    with open(TEMPLATE_DIR / f"{name}.jinja", encoding="utf-8", newline="") as f:
        return f.read()


def hf_render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
              **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


def special_vars(name: str) -> dict[str, str]:
    # What both tokenizers pass for special tokens the model has.
    return {k: v for k, v in SPECIAL_TOKENS[name].items() if v is not None}


# --- conversations ------------------------------------------------------------------------------

SYSTEM_USER = [
    {"role": "system", "content": "You are terse. Answer in <= 5 words & no \"quotes\"."},
    {"role": "user", "content": "Wie heißt die Hauptstadt von Frankreich? 日本語も"},
]
USER_ONLY = [{"role": "user", "content": "Hello!"}]
MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times 3?"},
]
MULTI_TURN_NO_SYSTEM = MULTI_TURN[1:]
EMPTY_SYSTEM = [{"role": "system", "content": ""}, *MULTI_TURN_NO_SYSTEM]  # Phi-3.5 skips it

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city; units: <celsius> & \"fahrenheit\". Zürich ok.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

# OpenAI-style: an assistant turn that calls tools, then one `tool` message per call.
TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {"role": "assistant", "content": "",
     "tool_calls": [
         {"id": "call0abcd", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}},
         {"id": "call1efgh", "type": "function",
          "function": {"name": "get_time", "arguments": {"city": "Zürich"}}},
     ]},
    {"role": "tool", "tool_call_id": "call0abcd",
     "content": "{\"temp\": 21, \"sky\": \"<sunny>\"}"},
    {"role": "tool", "tool_call_id": "call1efgh", "content": "14:05"},
    {"role": "assistant", "content": "21 °C and sunny; it is 14:05."},
    {"role": "user", "content": "Thanks!"},
]
# The turn still in progress: the tool results are the last messages.
TOOL_CONVERSATION_PENDING = TOOL_CONVERSATION[:5]
# Qwen3's template also takes arguments already serialized as a JSON string.
TOOL_CONVERSATION_STRING_ARGS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"id": "call2ijkl", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call2ijkl", "content": "-3 and snow"},
]

# Qwen3: reasoning given as a field, or left inside the content as <think>...</think>.
THINKING_FIELD = [
    {"role": "user", "content": "What is 17*3?"},
    {"role": "assistant", "content": "51.", "reasoning_content": "17*3 = 51."},
    {"role": "user", "content": "And 51/3?"},
    {"role": "assistant", "content": "17.", "reasoning_content": "\nInverse of before.\n"},
]
THINKING_IN_CONTENT = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "What is 17*3?"},
    {"role": "assistant", "content": "<think>\n17*3 = 51.\n</think>\n\n51."},
    {"role": "user", "content": "And 51/3?"},
]
THINKING_LAST_TURN = THINKING_IN_CONTENT + [
    {"role": "assistant", "content": "<think>\n51/3 = 17.\n</think>\n\n17."},
]
# Tool calls inside a reasoning turn: the turn after the last real user query keeps its thoughts.
THINKING_WITH_TOOLS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call get_weather.",
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "-3 and snow"},
    {"role": "assistant", "content": "It is -3 °C and snowing.",
     "reasoning_content": "The tool answered."},
]

# (template, messages, extra template variables) rendered with add_generation_prompt True and False.
CASES: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    (QWEN25, SYSTEM_USER, {}),
    (QWEN25, USER_ONLY, {}),
    (QWEN25, MULTI_TURN, {}),
    (QWEN25, MULTI_TURN_NO_SYSTEM, {"tools": TOOLS}),
    (QWEN25, TOOL_CONVERSATION, {"tools": TOOLS}),
    (QWEN25, TOOL_CONVERSATION_PENDING, {"tools": TOOLS}),
    (QWEN3, SYSTEM_USER, {}),
    (QWEN3, USER_ONLY, {"enable_thinking": False}),
    (QWEN3, MULTI_TURN, {"enable_thinking": True}),
    (QWEN3, SYSTEM_USER, {"enable_thinking": False}),
    (QWEN3, TOOL_CONVERSATION, {"tools": TOOLS}),
    (QWEN3, TOOL_CONVERSATION_PENDING, {"tools": TOOLS, "enable_thinking": False}),
    (QWEN3, TOOL_CONVERSATION_STRING_ARGS, {"tools": [WEATHER_TOOL]}),
    (QWEN3, THINKING_FIELD, {}),
    (QWEN3, THINKING_FIELD, {"enable_thinking": False}),
    (QWEN3, THINKING_IN_CONTENT, {"enable_thinking": False}),
    (QWEN3, THINKING_LAST_TURN, {}),
    (QWEN3, THINKING_WITH_TOOLS, {"tools": [WEATHER_TOOL]}),
    (PHI3, SYSTEM_USER, {}),
    (PHI3, MULTI_TURN, {}),
    (PHI35, MULTI_TURN, {}),
    (PHI35, EMPTY_SYSTEM, {}),
    (MIXTRAL, SYSTEM_USER, {}),
    (MIXTRAL, MULTI_TURN, {}),
    (MIXTRAL, MULTI_TURN_NO_SYSTEM, {}),
    (MISTRAL_NEMO, SYSTEM_USER, {}),
    (MISTRAL_NEMO, MULTI_TURN, {}),
    (MISTRAL_NEMO, MULTI_TURN_NO_SYSTEM, {"tools": TOOLS}),
    (MISTRAL_NEMO, TOOL_CONVERSATION, {"tools": TOOLS}),
    (MISTRAL_NEMO, TOOL_CONVERSATION_PENDING, {"tools": TOOLS}),
]


_CONVERSATION_NAMES = {id(v): k.lower() for k, v in list(globals().items())
                       if k.isupper() and isinstance(v, list)}


def _case_id(case: tuple[str, list[dict[str, Any]], dict[str, Any]]) -> str:
    name, messages, variables = case
    extra = ",".join(k if isinstance(v, list) else f"{k}={v}" for k, v in variables.items())
    return ":".join(filter(None, [name, _CONVERSATION_NAMES[id(messages)], extra]))


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_renderer_matches_transformers(case: tuple[str, list[dict[str, Any]], dict[str, Any]],
                                       add_generation_prompt: bool) -> None:
    name, messages, variables = case
    template = load_template(name)
    variables = {**special_vars(name), **variables}
    expected = hf_render(template, messages, add_generation_prompt, **variables)
    assert render_chat_template(template, messages, add_generation_prompt, **variables) == expected


def test_qwen_renders_what_the_model_expects() -> None:
    # Spot checks of the reference itself, so a broken comparison cannot pass silently.
    qwen25 = render_chat_template(load_template(QWEN25), USER_ONLY, True)
    assert qwen25 == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                      "helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
                      "<|im_start|>assistant\n")
    tools = render_chat_template(load_template(QWEN25), TOOL_CONVERSATION, True, tools=TOOLS)
    # tojson as transformers has it: no HTML escaping, no ASCII escaping.
    assert '"description": "Current weather in a city; units: <celsius> & \\"fahrenheit\\". ' \
           'Zürich ok."' in tools
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
            '"unit": "celsius"}}\n</tool_call>') in tools
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21, \"sky\": \"<sunny>\"}\n" \
           "</tool_response>\n<tool_response>\n14:05\n</tool_response><|im_end|>\n" in tools

    qwen3 = load_template(QWEN3)
    no_think = render_chat_template(qwen3, USER_ONLY, True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat_template(qwen3, USER_ONLY, True).endswith("<|im_start|>assistant\n")
    # Earlier turns lose their reasoning; the turn after the last user query keeps it.
    history = render_chat_template(qwen3, THINKING_FIELD, False)
    assert "17*3 = 51." not in history
    assert "<|im_start|>assistant\n<think>\nInverse of before.\n</think>\n\n17.<|im_end|>\n" \
        in history


def test_qwen3_reasoning_under_other_names() -> None:
    # transformers copies `reasoning` / `thinking` (vLLM's and gpt-oss's names) into
    # `reasoning_content`, the one Qwen3's template reads.
    template = load_template(QWEN3)
    for field in ("reasoning", "thinking"):
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", field: "Greet back."},
        ]
        expected = hf_render(template, messages, False)
        assert "<think>\nGreet back.\n</think>\n\nHello." in expected
        assert render_chat_template(template, messages, False) == expected


@pytest.mark.parametrize("name,messages,variables", [
    (MIXTRAL, [{"role": "assistant", "content": "first"}], {}),
    (MIXTRAL, [{"role": "tool", "content": "x"}], {}),
    (MISTRAL_NEMO, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}),
    # Mistral's tool call ids must be 9 characters.
    (MISTRAL_NEMO, [{"role": "user", "content": "a"},
                    {"role": "assistant", "tool_calls": [
                        {"id": "short", "function": {"name": "f", "arguments": {}}}]}], {}),
])
def test_template_rejections_match(name: str, messages: list[dict[str, Any]],
                                   variables: dict[str, Any]) -> None:
    template = load_template(name)
    variables = {**special_vars(name), **variables}
    with pytest.raises(jinja2.TemplateError) as ref:
        hf_render(template, messages, True, **variables)
    with pytest.raises(jinja2.TemplateError) as ours:
        render_chat_template(template, messages, True, **variables)
    assert str(ours.value) == str(ref.value)


# --- environment: what transformers' jinja environment has -------------------------------------

def test_generation_tag_renders_its_body() -> None:
    # transformers' AssistantTracker: `{% generation %}` marks assistant tokens for training
    # masks; rendering keeps the body as is (SmolLM3 and others use it).
    template = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
                "{% endif %}\n{% endfor %}")
    messages = MULTI_TURN
    assert render_chat_template(template, messages, False) == hf_render(template, messages, False)


def test_environment_builtins_match() -> None:
    template = (
        "{%- set ns = namespace(n=0, items=[]) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}|{{ dict(a=1, b='<&>') | tojson }}|{{ tools | tojson(indent=2) }}|"
        "{{ documents is none }}|{{ tools is defined }}|{{ 'é<' | tojson }}|"
        "{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=true, separators=(',', ':')) }}|"
        "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}"
        "{% endif %}{{ i }}{% endfor %}|{{ bos_token is defined }}"
    )
    for variables in ({}, {"tools": [WEATHER_TOOL]}):
        ours = render_chat_template(template, USER_ONLY, True, **variables)
        assert ours == hf_render(template, USER_ONLY, True, **variables)
    assert render_chat_template(template, USER_ONLY, True).startswith(
        '1|{"a": 1, "b": "<&>"}|null|True|True|"é<"|{"a":[1,2],"b":1}|02|False')


def test_trim_and_lstrip_blocks() -> None:
    template = "  {% if add_generation_prompt %}\nA\n  {% endif %}\n{{ messages | length }}\n"
    assert render_chat_template(template, USER_ONLY, True) == hf_render(template, USER_ONLY, True)
    # Jinja drops the one trailing newline (keep_trailing_newline is off in both).
    assert render_chat_template(template, USER_ONLY, True) == "A\n1"


def test_strftime_now() -> None:
    # Both renderers read the clock, so their outputs can only agree up to the time between the
    # two calls: assert ours is the date at the moment of rendering.
    template = "{{ strftime_now('%d %b %Y') }}"
    before = datetime.now().strftime("%d %b %Y")
    ours = render_chat_template(template, USER_ONLY, True)
    after = datetime.now().strftime("%d %b %Y")
    assert ours in (before, after)


@pytest.mark.parametrize("template,error", [
    # The messages are read-only to the template (immutable sandbox).
    ("{{ messages.append({'role': 'x'}) }}", jinja2.exceptions.SecurityError),
    ("{% set m = messages[0] %}{{ m.update({'content': 'x'}) }}", jinja2.exceptions.SecurityError),
    ("{{ messages.__class__.__mro__ }}", jinja2.exceptions.SecurityError),
    ("{{ ''.__class__.__subclasses__() }}", jinja2.exceptions.SecurityError),
    # transformers' namespace refuses underscore attributes.
    ("{% set ns = namespace(_x=1) %}", jinja2.exceptions.SecurityError),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", jinja2.exceptions.SecurityError),
    ("{{ raise_exception('nope') }}", jinja2.exceptions.TemplateError),
])
def test_sandbox(template: str, error: type[Exception]) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(error):
        render_chat_template(template, messages, True)
    with pytest.raises(error):
        hf_render(template, messages, True)
    assert messages == [{"role": "user", "content": "hi"}]


def test_inputs_are_plain_data() -> None:
    # Objects in the inputs are rebuilt as plain JSON data before the template sees them (as
    # transformers does), so a template cannot reach their methods.
    class Rich(str):
        def dangerous(self) -> str:
            return "called"

    template = "{{ messages[0].content.dangerous is defined }}|{{ x.dangerous is defined }}"
    messages = [{"role": "user", "content": Rich("hi")}]
    assert render_chat_template(template, messages, True, x=Rich("y")) == "False|False"
    assert hf_render(template, messages, True, x=Rich("y")) == "False|False"


# --- through chunkserve's Tokenizer, from a HF folder ------------------------------------------

def _bundled_tokenizer_json() -> str:
    with gzip.open(os.path.join(BUNDLED_TOKENIZER_DIR, "tokenizer.json.gz"), "rt",
                   encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per template, a HF folder: the bundled (SmolLM2) tokenizer.json, given the special tokens
    the template needs that it lacks, and a tokenizer_config.json carrying the template (Qwen3's
    in chat_template.jinja instead, the file newer transformers write)."""
    tok = HFTokenizer.from_str(_bundled_tokenizer_json())
    needed = {t for spec in SPECIAL_TOKENS.values() for t in spec.values() if t is not None}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in sorted(needed) if tok.token_to_id(t) is None])
    folders = {}
    for name, spec in SPECIAL_TOKENS.items():
        folder = tmp_path_factory.mktemp(name)
        tok.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {**spec, "add_bos_token": False, "add_eos_token": False,
                                  "tokenizer_class": "PreTrainedTokenizerFast"}
        if name == QWEN3:
            (folder / "chat_template.jinja").write_text(load_template(name), encoding="utf-8")
        else:
            config["chat_template"] = load_template(name)
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        folders[name] = folder
    return folders


class _Pair:
    """chunkserve's Tokenizer for one template's folder, and transformers' tokenizer for a folder
    with the same special tokens (loading one takes ~0.5 s: one per special-token set), given the
    template explicitly."""

    def __init__(self, name: str, ours: Tokenizer, ref: Any) -> None:
        self.name, self.ours, self.ref = name, ours, ref

    def ref_render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   **kwargs: Any) -> str:
        return self.ref.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt,
                                            chat_template=load_template(self.name), **kwargs)


@pytest.fixture(scope="module")
def tokenizers(hf_folders: dict[str, Path]) -> dict[str, _Pair]:
    from transformers import PreTrainedTokenizerFast

    refs: dict[tuple[Any, ...], Any] = {}
    pairs = {}
    for name, folder in hf_folders.items():
        key = tuple(SPECIAL_TOKENS[name].items())
        if key not in refs:
            refs[key] = PreTrainedTokenizerFast.from_pretrained(str(folder))
            assert refs[key].chat_template == load_template(name)  # read as we read it
        pairs[name] = _Pair(name, Tokenizer.from_hf_dir(str(folder)), refs[key])
    return pairs


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_tokenizer_matches_transformers(case: tuple[str, list[dict[str, Any]], dict[str, Any]],
                                        add_generation_prompt: bool,
                                        tokenizers: dict[str, _Pair]) -> None:
    name, messages, variables = case
    pair = tokenizers[name]
    assert pair.ours.chat_template == load_template(name)
    expected = pair.ref_render(messages, add_generation_prompt, **variables)
    assert pair.ours.apply_chat_template(messages, add_generation_prompt, **variables) == expected
    # The token ids too: the prompt text is encoded without adding special tokens again.
    assert pair.ours.encode(expected, add_special_tokens=False) == pair.ref.encode(
        expected, add_special_tokens=False)


def test_tokenizer_passes_template_kwargs(tokenizers: dict[str, _Pair]) -> None:
    # Extra keyword arguments of apply_chat_template reach the template: enable_thinking=False
    # turns Qwen3's thinking off with an empty think block.
    pair = tokenizers[QWEN3]
    thinking = pair.ours.apply_chat_template(USER_ONLY, True)
    not_thinking = pair.ours.apply_chat_template(USER_ONLY, True, enable_thinking=False)
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"
    assert not_thinking == pair.ref_render(USER_ONLY, True, enable_thinking=False)


def test_tokenizer_drops_none_fields(tokenizers: dict[str, _Pair]) -> None:
    # OpenAI clients send `"content": null` beside tool_calls and null optional fields;
    # transformers drops None-valued keys first (a template would otherwise fail on
    # `'</think>' in None` or print "None").
    messages = [
        {"role": "user", "content": "Weather in Oslo?", "name": None},
        {"role": "assistant", "content": None, "reasoning_content": None,
         "tool_calls": [{"id": "call2ijkl", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call2ijkl", "content": "-3 and snow"},
    ]
    # A template that tells a missing key from a None one.
    template = ("{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }})"
                "{% endif %}: {{ m.content | default('-') }}\n{% endfor %}")
    qwen = tokenizers[QWEN25]
    ours = Tokenizer(qwen.ours.hf_tokenizer, bos_token_id=None, eos_token_id=None, add_bos=False,
                     chat_template=template)
    expected = qwen.ref.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert expected == "user: Weather in Oslo?\nassistant: -\ntool: -3 and snow\n"
    assert ours.apply_chat_template(messages, False) == expected
    for name in (QWEN25, MISTRAL_NEMO):
        pair = tokenizers[name]
        expected = pair.ref_render(messages, True, tools=TOOLS)
        assert pair.ours.apply_chat_template(messages, True, tools=TOOLS) == expected
        assert "None" not in expected
    # This Qwen3 template (as released) needs an assistant's content when it follows the last
    # user query (`'\n' + content`): both refuse alike. A server should send "" for null.
    pair = tokenizers[QWEN3]
    with pytest.raises(jinja2.UndefinedError):
        pair.ref_render(messages, True, tools=TOOLS)
    with pytest.raises(jinja2.UndefinedError):
        pair.ours.apply_chat_template(messages, True, tools=TOOLS)
