"""Parsing and validating request bodies, shared by the OpenAI routes and the internal P/D routes (the checks
against the served model, shared with the router, are in tandem.openai.protocol)."""

from __future__ import annotations

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from tandem.errors import APIError, validation_error


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    try:
        # orjson, as the router's pydantic parser: strict JSON (no NaN), and strings that are valid UTF-8 (a lone
        # surrogate, which json.loads lets through, would fail later in the tokenizer as a 500).
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    return validate_payload(payload, model)


def validate_payload(payload, model: type[BaseModel]) -> BaseModel:
    """A decoded JSON body as `model`, or an OpenAI-style 400 naming the first bad parameter."""
    if not isinstance(payload, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
