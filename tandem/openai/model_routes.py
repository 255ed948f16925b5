"""GET /v1/models and /v1/models/{model} (the OpenAI SDK's models.list and models.retrieve), on workers and routers
alike: the served model and its LoRA adapters, their cards made per request (their `created` is the time of asking)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from tandem.openai.protocol import ModelCard, ModelList, model_not_found


def add_model_routes(app: FastAPI, served_name: str, max_model_len: Callable[[], int],
                     adapters: Callable[[], list[str]] = list) -> None:
    """`max_model_len` is asked per request: a router learns its workers' context length after it starts;
    `adapters`: the LoRA adapters served now, listed with the served model as their parent."""

    def cards() -> list[ModelCard]:
        limit = max_model_len()
        return [ModelCard(id=served_name, root=served_name, max_model_len=limit),
                *(ModelCard(id=name, root=name, parent=served_name, max_model_len=limit) for name in adapters())]

    @app.get("/v1/models")
    async def models():
        return ModelList(data=cards()).model_dump()

    @app.get("/v1/models/{model_id:path}")  # model ids may hold "/"
    async def model(model_id: str):
        card = next((c for c in cards() if c.id == model_id), None)
        if card is None:
            raise model_not_found(served_name, model_id)
        return card.model_dump()
