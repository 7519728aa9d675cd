"""The request fields that ask for structured outputs, as one `StructuredOutputsParams`.

Clients ask three ways, all accepted as vLLM accepts them:
- OpenAI's `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- vLLM's `structured_outputs` object: `{"json": ...}`, `{"regex": ...}`, `{"choice": [...]}`,
  `{"grammar": ...}` or `{"json_object": true}`.
At most one may be sent; a malformed one is a 400 naming the field. json_schema's `strict`
(false unless sent, as in OpenAI's API) decides what a keyword the grammar cannot enforce does:
a 400 when strict, left unenforced otherwise (StructuredOutputsParams.strict); vLLM's fields
are always strict. Whether the schema, regex
or grammar itself compiles is the Processor's check (engine/grammar.py), also a 400.
"""
from __future__ import annotations

from typing import Any

from chunkserve.sampling_params import StructuredOutputsParams
from chunkserve.serve.http.errors import field_error

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The one structured-output constraint a request sent, if any."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = _response_format(request.response_format)
    if response_format is not None:
        found.append(("response_format", response_format))
    for field, key in _GUIDED.items():
        value = getattr(request, field)
        if value is not None:
            found.append((field, _params(field, **{key: value})))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _structured(request.structured_outputs)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise field_error(f"Send one structured-output constraint, not several ({names}).",
                          found[1][0])
    return found[0][1] if found else None


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise field_error(f"{field}: {e}", field) from None


def _structured(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise field_error("structured_outputs must be an object.", "structured_outputs")
    # vLLM's object has more keys (e.g. disable_any_whitespace); the constraint is one of these.
    unknown = sorted(k for k, v in value.items() if k not in _KEYS and v not in (None, False))
    if unknown:
        raise field_error(f"structured_outputs: unsupported key(s) {unknown}; give one of "
                          f"{list(_KEYS)}.", "structured_outputs")
    return _params("structured_outputs", **{k: value.get(k) for k in _KEYS})


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise field_error(f"response_format type must be text, json_object or json_schema, "
                          f"got {kind!r}.", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise field_error("response_format json_schema must be an object with a `schema` "
                          "object.", "response_format")
    # OpenAI's schema-less json_schema means any JSON object; `strict` defaults to false.
    schema = spec.get("schema") or {"type": "object"}
    return _params("response_format", json=schema, strict=spec.get("strict") is True)
