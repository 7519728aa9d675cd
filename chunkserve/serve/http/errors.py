"""vLLM's error body, and how a request that fails validation becomes one.

`field_error` is what the request models raise; `validation_error_message` turns pydantic's
errors (those, and its own) into one message and the offending top-level param; `error_body`
is the JSON the server sends.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:  # only for the annotation: errors.py must not need fastapi to import
    import pydantic
    from fastapi.exceptions import RequestValidationError


def field_error(message: str, param: str | None = None) -> PydanticCustomError:
    """The error a request validator raises: a 400 with `message`, naming `param`."""
    # A custom error (not ValueError) keeps pydantic's "Value error, " prefix off the message,
    # and ctx carries the param name for model-level checks, whose loc is empty.
    return PydanticCustomError("value_error", message, {"param": param} if param else None)


def encodable(text: str) -> str:
    """`text` with any lone surrogate escaped, so it encodes as UTF-8."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON: `{"error": {"message", "type", "param", "code"}}`.

    Text is made encodable first: a message may quote client input, and a lone surrogate in it
    would make the error response itself fail to encode (a 500 in place of the 4xx).
    """
    info = ErrorInfo(message=encodable(message), type=err_type,
                     param=None if param is None else encodable(param), code=code)
    return ErrorResponse(error=info).model_dump()


_LOC_SOURCES = {"body", "query", "path", "header", "cookie"}


def validation_error_message(
    exc: pydantic.ValidationError | RequestValidationError,
) -> tuple[str, str | None]:
    """One readable message for all errors, and the first offending top-level param.

    E.g. ("temperature: Input should be a valid number, ...", "temperature").
    """
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        # FastAPI prefixes where the value came from; the client thinks in field names.
        # A missing body keeps its "body" label: there is no field to name instead.
        if loc and loc[0] in _LOC_SOURCES and not (len(loc) == 1 and err.get("type") == "missing"):
            loc = loc[1:]
        msg = str(err.get("msg", "invalid value"))
        ctx = err.get("ctx") or {}
        if err.get("type") == "json_invalid" and ctx.get("error"):
            msg = f"{msg}: {ctx['error']}"
        field = loc[0] if loc and isinstance(loc[0], str) else ctx.get("param")
        if param is None and isinstance(field, str):
            param = field
        # Integer-only locs are JSON byte positions, not fields; leave them out of the label.
        label = ".".join(str(x) for x in loc) if loc and isinstance(loc[0], str) else ""
        text = f"{label}: {msg}" if label else msg
        if text not in parts:
            parts.append(text)
    return "; ".join(parts) or "Invalid request", param
