"""Structured outputs (issue 31; engine/grammar.py): every output of a JSON schema validates,
greedy and sampled, whatever the chunk budget and through preemption; regexes and choices
match; the sampler's mask lets nothing else through; a bad constraint is a ValueError; the step
trace counts the masked rows and their time."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.engine.sampler import Sampler, SamplingRow
from chunkserve.engine.trace import read_trace
from chunkserve.sampling_params import StructuredOutputsParams as Structured

# Tight bounds keep every output short (each token is a decode step) and well under max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string",
                                                               "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
BOOK = {"type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20},
                       "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
                       "genres": {"type": "array", "items": {"enum": ["fiction", "science",
                                                                     "history"]},
                                  "minItems": 1, "maxItems": 2}},
        "required": ["title", "year", "genres"], "additionalProperties": False}
PROMPTS = [("A user record as JSON:", PERSON), ("A book as JSON:", BOOK)]


def _params(schema: dict, sampled: bool) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=0.8 if sampled else 0.0,
                          seed=7 if sampled else None, structured_outputs=Structured(json=schema))


def _generate(llm: LLM, copies: int = 1) -> list[str]:
    """Greedy and sampled requests for every schema (`copies` times), each output validated."""
    prompts, params = [], []
    for sampled in (False, True):
        for prompt, schema in PROMPTS * copies:
            prompts.append(prompt)
            params.append(_params(schema, sampled))
    outs = llm.generate(prompts, params)
    for out, p in zip(outs, params):
        schema = p.structured_outputs.json  # type: ignore[union-attr]
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    return [o.outputs[0].text for o in outs]


def test_json_schemas_validate_across_budgets_and_preemption() -> None:
    from chunkserve.model.factory import load_model

    loaded = load_model("smollm2-135m", max_model_len=256)  # one load, both engines' weights
    # A pool of 6 blocks of 16 holds one request of max_model_len 96; the four requests start
    # in a block each and every one outgrows it (prompt + the shortest valid JSON > 16 tokens),
    # so preemption is forced.
    chunked = LLM(loaded=loaded, model=loaded.path, max_num_batched_tokens=16, num_kv_blocks=6,
                  max_model_len=96, enable_prefix_caching=False)
    texts = _generate(chunked)
    assert chunked.engine.scheduler.num_preemptions > 0  # the matchers survived recompute
    chunked.engine.close()
    whole = LLM(loaded=loaded, model=loaded.path, max_num_batched_tokens=128, max_model_len=256)
    assert _generate(whole)[:2] == texts[:2]  # greedy: the same JSON whatever the budget
    whole.engine.close()


def test_regex_and_choice_outputs_match() -> None:
    llm = LLM(model="smollm2-135m", max_num_batched_tokens=64, max_model_len=256)
    phone = r"\d{3}-\d{3}-\d{4}"
    choice = ["positive", "negative", "neutral"]
    outs = llm.generate(
        ["Call me at", "Sentiment of 'what a great day':", "Sentiment:"],
        [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=Structured(regex=phone)),
         SamplingParams(max_tokens=10, temperature=0.0,
                        structured_outputs=Structured(choice=choice)),
         SamplingParams(max_tokens=10, temperature=1.0, seed=3,
                        structured_outputs=Structured(choice=choice))])
    assert re.fullmatch(phone, outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in choice and outs[2].outputs[0].text in choice
    with pytest.raises(ValueError, match="regex is invalid"):
        llm.generate(["x"], SamplingParams(structured_outputs=Structured(regex="[a-")))
    with pytest.raises(ValueError, match="JSON schema is invalid: .*weird"):
        llm.generate(["x"], SamplingParams(structured_outputs=Structured(
            json={"type": "string", "format": "weird"})))
    llm.engine.close()


def test_trace_counts_masked_rows_and_their_time(tmp_path: Path) -> None:
    trace = str(tmp_path / "steps.jsonl")
    llm = LLM(model="smollm2-135m", max_num_batched_tokens=64, max_model_len=128,
              trace_file=trace)
    choice = Structured(choice=["yes", "no", "maybe so"])
    outs = llm.generate(["Is it raining?", "Free text:", "Answer:"],
                        [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice),
                         SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice)])
    llm.engine.close()
    records = read_trace(trace)
    # Each token of a structured output was sampled under one mask; the free request's none.
    masked = len(outs[0].outputs[0].token_ids) + len(outs[2].outputs[0].token_ids)
    assert sum(r.num_grammar_rows for r in records) == masked
    assert all((r.grammar_mask_time > 0) == (r.num_grammar_rows > 0) for r in records)
    assert all(r.grammar_mask_time < r.duration for r in records)
    assert records[-1].num_grammar_rows == 0  # the free request ran on alone


def test_one_constraint_at_a_time() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Structured(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        Structured()
    with pytest.raises(ValueError, match="non-empty list"):
        Structured(choice=[])


def test_the_mask_lets_only_allowed_tokens_through() -> None:
    vocab = 100
    allowed = [3, 40, 77]
    words = np.zeros(4, dtype=np.int32)
    for t in allowed:
        words[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(1 << 31))
    logits = torch.randn(2, vocab + 28)  # columns past the mask's vocabulary: never taken
    logits[:, 5] = 100.0  # the unconstrained favourite
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, 0, [], allowed=words),
            SamplingRow(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), 0,
                        [], allowed=words)]
    for _ in range(20):
        out = Sampler()(logits, rows)
        assert all(t in allowed for t in out.token_ids)
        assert out.grammar_time > 0  # the trace's grammar_mask_time includes the apply
    free = SamplingRow(SamplingParams(temperature=0.0), None, 0, [])
    unmasked = Sampler()(logits[:1], [free])
    assert unmasked.token_ids == [5] and unmasked.grammar_time == 0  # the favourite wins


def test_strict_decides_what_an_unenforceable_keyword_does() -> None:
    """OpenAI's `strict`: true refuses a schema keyword the grammar cannot enforce; false
    leaves that keyword out and still enforces the rest of the schema."""
    from chunkserve.engine.grammar import GrammarCompiler
    from chunkserve.tokenizer.tokenizer import load_bundled_tokenizer

    tokenizer = load_bundled_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_token_id)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False, "dependentRequired": {"a": ["b"]}}
    with pytest.raises(ValueError, match="dependentRequired"):
        compiler.compile(Structured(json=schema))
    grammar = compiler.compile(Structured(json=schema, strict=False))
    for text, ok in (('{"a":12}', True), ('{"a":"x"}', False), ('{"b":1}', False)):
        tokens = tokenizer.encode(text, add_special_tokens=False)
        taken = compiler.matcher(grammar).validate_tokens(tokens)
        assert (taken == len(tokens)) == ok, text
    with pytest.raises(ValueError, match="Invalid type"):  # an invalid schema stays an error
        compiler.compile(Structured(json={"type": "strin"}, strict=False))
