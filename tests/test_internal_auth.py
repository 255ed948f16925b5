"""The workers' internal endpoints refuse callers without the deployment's shared secret (tandem.internal_auth)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from tandem.internal_auth import INTERNAL_TOKEN_HEADER, InternalAuth


def app_with(token: str | None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(InternalAuth, token=token)

    @app.get("/internal/load")
    async def load():
        return {"running": 0}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.websocket("/internal/ws")
    async def channel(ws: WebSocket):
        await ws.accept()
        await ws.send_json({"hello": True})
        await ws.close()

    return app


def test_internal_http_needs_the_token_and_public_routes_do_not():
    client = TestClient(app_with("s3cret"))
    refused = client.get("/internal/load")
    assert refused.status_code == 401 and refused.json()["error"]["message"].startswith("internal endpoint")
    assert client.get("/internal/load", headers={INTERNAL_TOKEN_HEADER: "wrong"}).status_code == 401
    assert client.get("/internal/load", headers={INTERNAL_TOKEN_HEADER: "s3cret"}).json() == {"running": 0}
    assert client.get("/v1/models").status_code == 200  # the OpenAI routes have their own keys (--api-key)


def test_the_router_channel_handshake_needs_the_token():
    client = TestClient(app_with("s3cret"))
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/internal/ws"):
        pass
    assert refused.value.code == 1008
    with client.websocket_connect("/internal/ws", headers={INTERNAL_TOKEN_HEADER: "s3cret"}) as ws:
        assert ws.receive_json() == {"hello": True}


def test_without_a_token_everything_is_open():
    client = TestClient(app_with(None))
    assert client.get("/internal/load").status_code == 200
    with client.websocket_connect("/internal/ws") as ws:
        assert ws.receive_json() == {"hello": True}
