"""The worker's LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies), and which
adapter a request's `model` names."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tandem.errors import APIError
from tandem.openai.model_routes import model_not_found
from tandem.server.internal_auth import INTERNAL_TOKEN_HEADER, internal_token
from tandem.workers.request_checks import parse_body


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, accepted and unused


def resolve_lora(ctx, model: str | None) -> str | None:
    """The adapter `model` names (None: the base model), or a 404 model_not_found."""
    if model is None or model == ctx.served_name:
        return None
    lora = ctx.engine.engine.lora
    if lora is not None and model in lora.paths:
        return model
    raise model_not_found(ctx.served_name, model)


def served_adapters(ctx) -> list[str]:
    lora = ctx.engine.engine.lora
    return [] if lora is None else lora.names


def _check_key(request: Request) -> None:
    """Changing what a worker serves takes the deployment's internal token, when one is set (as a bearer key or in
    its own header)."""
    token = internal_token()
    if token is None:
        return
    sent = request.headers.get(INTERNAL_TOKEN_HEADER) or request.headers.get("authorization", "").removeprefix("Bearer ")
    if not hmac.compare_digest(sent.encode(), token.encode()):
        raise APIError(401, "loading or unloading adapters needs the API key", code="invalid_api_key")


def add_lora_routes(app: FastAPI, ctx) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        _check_key(request)
        body: LoadLoRARequest = await parse_body(request, LoadLoRARequest)
        if body.lora_name == ctx.served_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:
            await ctx.engine.call(lambda engine: engine.add_lora(body.lora_name, body.lora_path))
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        _check_key(request)
        body: UnloadLoRARequest = await parse_body(request, UnloadLoRARequest)
        try:
            await ctx.engine.call(lambda engine: engine.remove_lora(body.lora_name))
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
