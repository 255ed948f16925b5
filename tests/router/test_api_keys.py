"""API keys at the front door: /v1/* needs a configured key as its bearer token; probes and scrapers stay open."""

import asyncio
import json

import httpx
import pytest
from starlette.responses import JSONResponse

from tandem.config import RouterConfig
from tandem.router.api_keys import ApiKeyGate, bearer_token
from tandem.router.main import Router, load_tenants


async def behind(scope, receive, send):
    await JSONResponse({"path": scope["path"]})(scope, receive, send)


def call(path: str, keys=("k-one", "k-two"), **headers) -> httpx.Response:
    gate = ApiKeyGate(behind, keys)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(go())


def test_a_configured_key_passes_and_anything_else_gets_an_openai_401():
    for key in ("k-one", "k-two"):
        assert call("/v1/models", authorization=f"Bearer {key}").json() == {"path": "/v1/models"}
    assert call("/v1/models", authorization="bearer k-one").status_code == 200  # the scheme is case-insensitive
    for headers in ({}, {"authorization": "Bearer k-three"}, {"authorization": "Bearer k-on"},
                    {"authorization": "Basic k-one"}, {"authorization": "Bearer "}, {"authorization": "k-one"}):
        r = call("/v1/chat/completions", **headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
        assert ("No API key" in error["message"]) == (bearer_token([(b"authorization", headers.get(
            "authorization", "").encode())]) is None), (headers, error)


def test_probes_metrics_and_the_schema_stay_open():
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert call(path).status_code == 200, path


def test_the_api_pages_need_the_key_too():
    """Found by a new user: /docs and /redoc stayed open on a router that required a key."""
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert call(path).status_code == 401, path
        assert call(path, authorization="Bearer k-one").status_code == 200, path


def test_the_api_pages_are_not_served_with_disable_fastapi_docs():
    from tandem.router.app import build_app

    def get(config: RouterConfig, path: str) -> int:
        app = build_app(Router(config))

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return (await client.get(path)).status_code

        return asyncio.run(go())

    for path in ("/docs", "/redoc", "/openapi.json"):
        assert get(RouterConfig(decode=["http://127.0.0.1:9"]), path) == 200, path
        assert get(RouterConfig(decode=["http://127.0.0.1:9"], disable_fastapi_docs=True), path) == 404, path


def test_a_gate_without_keys_is_a_mistake():
    with pytest.raises(ValueError):
        ApiKeyGate(behind, [])


def write_tenants(tmp_path, **spec) -> str:
    (tmp_path / "tenants.json").write_text(json.dumps(spec))
    return str(tmp_path)


def keys(**config) -> list[str]:
    return Router(RouterConfig(decode=["http://127.0.0.1:9"], **config)).api_keys


def test_which_keys_the_router_requires(tmp_path, monkeypatch):
    """None configured: open. A key from --api-key or $TANDEM_API_KEY turns the gate on, and a tenant's key is
    then accepted too; the tenants file alone turns it on only with requireApiKey."""
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_TENANTS_DIR", raising=False)
    assert keys() == []
    assert keys(api_key=["ops"]) == ["ops"]
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert keys(api_key=["ops"]) == ["ops", "from-env"]
    monkeypatch.delenv("TANDEM_API_KEY")
    monkeypatch.setenv("TANDEM_TENANTS_DIR", write_tenants(tmp_path, apiKeys={"k-alice": "alice"}))
    assert keys() == []  # keys name tenants, but unknown callers are still served
    assert keys(api_key=["ops"]) == ["ops", "k-alice"]
    monkeypatch.setenv("TANDEM_TENANTS_DIR", write_tenants(tmp_path, apiKeys={"k-alice": "alice"}, requireApiKey=True))
    assert keys() == ["k-alice"]


def test_require_api_key_without_keys_refuses_to_start(tmp_path):
    with pytest.raises(SystemExit, match="requireApiKey"):
        load_tenants(write_tenants(tmp_path, requireApiKey=True))
