"""The `json-schema` dataset: requests whose output is constrained by a JSON schema, so the cost
of structured outputs (the grammar mask of every sampled token) shows in TPOT.

As vLLM's benchmark_serving_structured_output.py does for its `json` dataset, each prompt asks
for an example of the schema and shows it; the request carries the schema as a constraint
(bench/client.py: `response_format` on /v1/chat/completions, `structured_outputs` on
/v1/completions). Three built-in schemas, no download: a person record, a book, and an order
whose items array has bounds and enums. Every string and array is bounded and no object takes
extra properties, so any output the grammar allows ends within a bounded number of tokens even
from a model that ignores the prompt. The output length is a cap (max_tokens): a request stops
when its JSON is complete.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from chunkserve.benchlib.workloads import BenchRequest, BenchTokenizer

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}

PERSON: dict[str, Any] = {
    "title": "person",
    "type": "object",
    "properties": {
        "name": _NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object",
                    "properties": {"city": _NAME, "country": _NAME},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "role", "address"],
    "additionalProperties": False,
}

BOOK: dict[str, Any] = {
    "title": "book",
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "author": _NAME,
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["fiction", "science", "history",
                                                       "poetry"]},
                   "minItems": 1, "maxItems": 3},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "author", "year", "genres", "in_print"],
    "additionalProperties": False,
}

ORDER: dict[str, Any] = {
    "title": "order",
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"sku": {"type": "string", "maxLength": 12},
                                           "quantity": {"type": "integer", "minimum": 1,
                                                        "maximum": 20}},
                            "required": ["sku", "quantity"], "additionalProperties": False}},
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "status", "items", "express"],
    "additionalProperties": False,
}

SCHEMAS: tuple[dict[str, Any], ...] = (PERSON, BOOK, ORDER)


def schema_prompt(schema: dict[str, Any]) -> str:
    """vLLM's prompt for its json dataset, with the schema's title as what to generate."""
    return (f"Generate an example of a {schema['title']} given the following JSON schema: "
            f"{json.dumps(schema, separators=(',', ':'))}")


def json_schema_requests(tokenizer: BenchTokenizer, num_prompts: int, seed: int,
                         output_len: int) -> list[BenchRequest]:
    """`num_prompts` requests, each for one of SCHEMAS drawn with `seed`; `output_len` is
    every request's max_tokens."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if output_len < 1:
        raise ValueError(f"the json-schema dataset's output length (--random-output-len) must "
                         f"be at least 1, got {output_len}")
    picks = np.random.default_rng(seed).integers(0, len(SCHEMAS), size=num_prompts)
    requests = []
    for k in picks:
        schema = SCHEMAS[int(k)]
        prompt = schema_prompt(schema)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        requests.append(BenchRequest(prompt, ids, len(ids), output_len, json_schema=schema))
    return requests
