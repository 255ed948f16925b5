"""The router and LoRA adapters: learned from the workers' load reports, chosen by `model`, placed on holders."""

from __future__ import annotations

import httpx
import pytest

from tandem.config import RouterConfig
from tandem.router.app import build_app
from tandem.router.main import Router

WORKERS = [f"http://127.0.0.1:{port}" for port in (11, 12, 13)]
HOLDS = {WORKERS[0]: ["sql"], WORKERS[1]: ["sql", "chat"], WORKERS[2]: []}


class ScriptedWorkers:
    """Decode workers that answer one token and record (worker, lora_name) of each decode."""

    def __init__(self):
        self.decodes: list[tuple[str, str | None]] = []

    async def event_batches(self, worker: str, path: str, body: dict):
        self.decodes.append((worker, body.get("lora_name")))
        yield [{"token_ids": [100], "text": "x", "finish_reason": "length"}]

    async def post_json(self, worker: str, path: str, payload: dict, timeout_s=None) -> dict:
        return {"ok": True}

    async def get(self, url: str, timeout=None) -> httpx.Response:
        worker = url.rsplit("/internal", 1)[0]
        load = {"free_blocks": 100, "total_blocks": 100, "running": 0, "waiting": 0, "role": "decode",
                "lora_adapters": HOLDS.get(worker, [])}
        return httpx.Response(200, json=load if url.endswith("/internal/load") else {"status": "ready"})


@pytest.fixture
async def router_client():
    router = Router(RouterConfig(decode=WORKERS))
    router.decode.set_members(WORKERS)
    router.orchestrator.http = router.decode.http = workers = ScriptedWorkers()
    for worker in router.decode.workers.values():
        await router.decode.probe(worker)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://r") as client:
        yield router, client, workers


async def complete(client, model: str, prompt: str) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})


async def test_adapter_requests_land_on_workers_holding_it(router_client):
    router, client, workers = router_client
    assert sorted(router.decode.workers[WORKERS[1]].lora_adapters) == ["chat", "sql"]
    for i in range(12):
        assert (await complete(client, "sql", f"prompt number {i} " * (i + 1))).status_code == 200
        assert (await complete(client, "chat", f"other prompt {i} " * (i + 1))).status_code == 200
    sql = {w for w, lora in workers.decodes if lora == "sql"}
    chat = {w for w, lora in workers.decodes if lora == "chat"}
    assert sql <= {WORKERS[0], WORKERS[1]} and chat == {WORKERS[1]}
    assert len(workers.decodes) == 24


async def test_models_list_adapters_and_unknown_is_404(router_client):
    router, client, _ = router_client
    cards = (await client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(router.served_name, None), ("chat", router.served_name),
                                                      ("sql", router.served_name)]
    missing = await complete(client, "nope", "hello")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert (await complete(client, router.served_name, "hello")).status_code == 200



async def test_router_hashes_match_the_workers(router_client):
    """The router's prefix hashes of an adapter's prompt are those the worker's prefix cache keys its blocks by."""
    from tandem.hashing import adapter_seed, block_hashes

    router, _, _ = router_client
    prompt = list(range(64))
    seed = router.orchestrator.hash_seed
    assert router.orchestrator.plan(prompt, "sql")[0] == block_hashes(prompt, 16, adapter_seed(seed, "sql"))
    assert router.orchestrator.plan(prompt, "sql")[0] != router.orchestrator.plan(prompt)[0]
