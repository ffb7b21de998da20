"""Reading a request body: its size, its content type, its JSON shape, its text -- all before a schema sees it.

Every refusal here is an ``APIError`` in the OpenAI shape: 413 for a body past
its byte limit, 415 for a body that is not JSON, 400 for JSON that is
malformed, nested deeper than ``MAX_JSON_DEPTH`` (checked on the raw bytes,
before the parser could recurse), or carries text that is not valid Unicode
(a lone surrogate such as ``"\\ud800"`` is legal JSON but no tokenizer takes
it: the error names the field). Types are strict (``validated``): JSON has
numbers, booleans and strings, and a ``"2"`` or a ``true`` is not an int.
"""
from __future__ import annotations

import json
import re

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .errors import APIError, ClientGone
from .limits import check_unicode

MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # the deepest real body (chat content parts) is 5
DRAIN_FACTOR = 4  # past its limit a body is still read (and dropped) up to this many limits, so the 413 arrives
# a JSON string literal, as an unrolled loop so that a long base64 payload is one fast run of [^"\\]*
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes ``limit`` bytes (declared or streamed).

    Past the limit the rest is read and dropped (up to ``DRAIN_FACTOR`` limits)
    instead of closing on a client still sending, which would lose the answer.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_FACTOR * limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DRAIN_FACTOR * limit:
                break
    except ClientDisconnect:
        raise ClientGone() from None
    if size > limit:
        raise _too_large(size, limit)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body is {size} bytes; the limit is {limit}", code="payload_too_large")


async def parse_body(request: Request, model: type[BaseModel], limit: int = MAX_BODY_BYTES):
    """The JSON body as ``model``: content type, size, depth and text checked first; extra_body flattened."""
    _check_json_type(request.headers.get("content-type"))
    data = json_object(await read_body(request, limit))
    nested = data.pop("extra_body", None)  # curl-style vLLM-Omni clients nest the extras
    if isinstance(nested, dict):
        for key, value in nested.items():
            data.setdefault(key, value)
    return validated(model, {key: _integral(value) for key, value in data.items()}, strict=True)


def _integral(value):
    """1.0 is the integer 1 in JSON and JSON Schema (so an int field takes it, and a float field takes the int);
    1.5, "1" and true stay what they are, and the strict schema refuses them for an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _check_json_type(content_type: str | None) -> None:
    """A body sent as text/plain (or a form) is refused; no content type at all is read as JSON (curl --data-raw)."""
    if content_type is None:
        return
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise APIError(415, f"the body must be application/json, got content type {content_type[:64]!r}",
                       code="unsupported_media_type")


def json_object(raw: bytes) -> dict:
    """``raw`` parsed as a JSON object whose nesting and text were checked."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the JSON body is nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}",
                       code="invalid_json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
    check_unicode(data)
    return data


def json_depth(raw: bytes) -> int:
    """The deepest bracket nesting of ``raw``, strings left out (a vectorised scan: no recursion, no parse)."""
    brackets = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    steps = np.isin(brackets, _OPEN).astype(np.int32) - np.isin(brackets, _CLOSE).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def validated(model: type[BaseModel], data: dict, strict: bool = False):
    """``data`` as ``model``; the first bad field is the error's ``param``, every bad field is in its message.

    ``strict``: JSON bodies (no string or bool for an int, no number for a bool); multipart form fields
    arrive as strings and are read in lax mode.
    """
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        field = ".".join(str(p) for p in errors[0]["loc"])
        detail = "; ".join(f"{'.'.join(str(p) for p in x['loc']) or 'body'}: {_reason(x)}" for x in errors)
        raise APIError(400, detail, param=field, code="invalid_value") from None


def _reason(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field"
    given = error.get("input")
    shown = "" if error["type"] == "missing" or isinstance(given, (dict, list)) else f" (got {given!r})"
    return error["msg"] + shown
