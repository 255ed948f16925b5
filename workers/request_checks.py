"""Parsing and validating request bodies, shared by the OpenAI routes and the internal P/D routes."""

from __future__ import annotations

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from tandem.errors import APIError
from tandem.protocol import SamplingParams


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
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


def check_token_ids(vocab_size: int, ids: list[int]) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")
    return ids


def check_length(max_model_len: int, prompt_len: int, params: SamplingParams) -> None:
    total = prompt_len + params.max_tokens
    if total > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {total} tokens ({prompt_len} in the prompt, {params.max_tokens} in the "
                            "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
