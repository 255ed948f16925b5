"""GET /v1/models and /v1/models/{model} (the OpenAI SDK's models.list and models.retrieve), on workers and routers
alike: one served model, its card made per request (its `created` is the time of asking)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from tandem.openai.protocol import ModelCard, ModelList, check_model


def add_model_routes(app: FastAPI, served_name: str, max_model_len: Callable[[], int]) -> None:
    """`max_model_len` is asked per request: a router learns its workers' context length after it starts."""

    def card() -> ModelCard:
        return ModelCard(id=served_name, max_model_len=max_model_len())

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # model ids may hold "/"
    async def model(model_id: str):
        check_model(served_name, model_id)
        return card().model_dump()
