"""Structured outputs (issue 31; engine/grammar.py): every output of a JSON schema validates,
greedy and sampled, whatever the chunk budget and through preemption; regexes and choices
match; the sampler's mask lets nothing else through; a bad constraint is a ValueError."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.engine.sampler import Sampler, SamplingRow
from chunkserve.sampling_params import StructuredOutputsParams as Structured

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string",
                                                               "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
BOOK = {"type": "object",
        "properties": {"title": {"type": "string", "maxLength": 30},
                       "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
                       "genres": {"type": "array", "items": {"enum": ["fiction", "science",
                                                                     "history"]},
                                  "minItems": 1, "maxItems": 2}},
        "required": ["title", "year", "genres"], "additionalProperties": False}
PROMPTS = [("A user record as JSON:", PERSON), ("A book as JSON:", BOOK)]


def _params(schema: dict, sampled: bool) -> SamplingParams:
    return SamplingParams(max_tokens=100, temperature=0.8 if sampled else 0.0,
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
    chunked = LLM(model="smollm2-135m", max_num_batched_tokens=16, num_kv_blocks=8,
                  max_model_len=128, enable_prefix_caching=False)
    texts = _generate(chunked, copies=2)  # eight requests in a pool for one
    assert chunked.engine.scheduler.num_preemptions > 0  # the matchers survived recompute
    chunked.engine.close()
    whole = LLM(model="smollm2-135m", max_num_batched_tokens=128, max_model_len=256)
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
    free = SamplingRow(SamplingParams(temperature=0.0), None, 0, [])
    assert Sampler()(logits[:1], [free]).token_ids == [5]  # unmasked, the favourite wins
