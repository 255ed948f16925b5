"""The workers' internal endpoints refuse callers without the deployment's shared secret (tandem.server.internal_auth)."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from tandem.runtimes.drain import drain
from tandem.server.internal_auth import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER, InternalAuth


def app_with(token: str | None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(InternalAuth, token=token)

    @app.get("/internal/load")
    async def load():
        return {"running": 0}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/internal/drain")
    async def start_draining():
        return {"draining": True}

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


def test_a_drain_with_the_wrong_token_fails_the_prestop_hook_so_kubernetes_says_so(monkeypatch, capsys):
    """Exit 0 would hide the misconfiguration: the pod would stop undrained with nothing said anywhere."""
    server = uvicorn.Server(uvicorn.Config(app_with("s3cret"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        monkeypatch.setenv(INTERNAL_TOKEN_ENV, "wrong")
        assert drain(url, timeout_s=5) == 1
        assert "refused the internal token (401)" in capsys.readouterr().err
        monkeypatch.setenv(INTERNAL_TOKEN_ENV, "s3cret")
        assert drain(url, timeout_s=0) == 0  # accepted (and no time given to wait)
    finally:
        server.should_exit = True
        thread.join(10)
