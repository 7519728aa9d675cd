"""`bench serve --dataset-name json-schema` (benchlib/json_schemas.py): the workload builds valid
constrained requests for both endpoints. Against a real server (/v1/completions) every output
parses and follows its schema: tests/test_bench_serve.py, on that module's server."""
from __future__ import annotations

import jsonschema
import pytest

from chunkserve.bench.client import build_payload, json_schema_body
from chunkserve.benchlib.json_schemas import SCHEMAS, json_schema_requests, schema_prompt
from chunkserve.benchlib.workloads import sample_requests
from chunkserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

BY_TITLE = {s["title"]: s for s in SCHEMAS}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> Tokenizer:
    return load_tokenizer(smollm2_path)


def test_schemas_are_valid_and_bounded() -> None:
    assert sorted(BY_TITLE) == ["book", "order", "person"]
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    order = BY_TITLE["order"]["properties"]
    assert order["items"]["maxItems"] == 3 and "enum" in order["status"]


def test_requests_are_seeded_and_carry_their_schema(tokenizer: Tokenizer) -> None:
    reqs = json_schema_requests(tokenizer, 30, seed=4, output_len=96)
    again = json_schema_requests(tokenizer, 30, seed=4, output_len=96)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]
    assert {r.json_schema["title"] for r in reqs} == set(BY_TITLE)  # type: ignore[index]
    for r in reqs:
        assert r.json_schema is not None and r.prompt == schema_prompt(r.json_schema)
        assert r.output_len == 96
        assert r.prompt_token_ids == tokenizer.encode(r.prompt, add_special_tokens=False)
        assert r.prompt_len == len(r.prompt_token_ids)
    with pytest.raises(ValueError, match="json_schema_requests"):
        sample_requests("json-schema", tokenizer, 3, 0)


def test_payloads_follow_each_endpoint() -> None:
    schema = BY_TITLE["book"]
    chat = build_payload(chat=True, model="m", prompt="p", output_len=8, ignore_eos=False,
                         temperature=None, extra_body=json_schema_body(chat=True, schema=schema))
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "book", "schema": schema}}
    assert "ignore_eos" not in chat and "structured_outputs" not in chat
    plain = build_payload(chat=False, model="m", prompt="p", output_len=8, ignore_eos=False,
                          temperature=None, extra_body=json_schema_body(chat=False, schema=schema))
    assert plain["structured_outputs"] == {"json": schema} and "response_format" not in plain
