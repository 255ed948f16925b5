"""The router's fast lane: its POST routes answer like the FastAPI app would, everything else passes through."""

import asyncio

import httpx
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse

from tandem.errors import APIError
from tandem.router.fast_lane import FastLane


class Body(BaseModel):
    model: str
    max_tokens: int = Field(16, ge=1)


async def handler(body: Body, request):
    if body.model == "missing":
        raise APIError(404, "no such model", param="model", code="model_not_found")
    return JSONResponse({"model": body.model, "max_tokens": body.max_tokens,
                         "slo": request.headers.get("x-tandem-slo-class")})


async def behind(scope, receive, send):
    """The app behind the lane: says who answered."""
    await JSONResponse({"answered_by": "app", "path": scope["path"]})(scope, receive, send)


def call(method: str, path: str, **kwargs) -> httpx.Response:
    lane = FastLane(behind, {"/v1/completions": (Body, handler)}, max_body_bytes=64)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=lane), base_url="http://t") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_lane_validates_and_calls_the_handler_with_the_request_headers():
    r = call("POST", "/v1/completions", json={"model": "m", "max_tokens": 3}, headers={"x-tandem-slo-class": "batch"})
    assert r.status_code == 200
    assert r.json() == {"model": "m", "max_tokens": 3, "slo": "batch"}


def test_other_paths_and_methods_go_to_the_app():
    assert call("GET", "/v1/completions").json() == {"answered_by": "app", "path": "/v1/completions"}
    assert call("POST", "/v1/models", json={}).json()["answered_by"] == "app"


def test_invalid_bodies_get_openai_errors():
    cases = [(b'{"model": ', 400, "not valid JSON", None), (b"[1, 2]", 400, "JSON object", None),
             (b"", 400, "JSON object", None), (b'{"model": "m", "max_tokens": 0}', 400, "max_tokens", "max_tokens"),
             (b'{"max_tokens": 2}', 400, "model", "model"), (b'{"model": "missing"}', 404, "no such model", "model")]
    for raw, status, fragment, param in cases:
        r = call("POST", "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, (raw, r.text)
        error = r.json()["error"]
        assert fragment in error["message"] and error["param"] == param, (raw, error)
        assert set(error) >= {"message", "type", "param", "code"}


def test_bodies_over_the_cap_get_413_declared_or_chunked():
    big = b'{"model": "' + b"x" * 100 + b'"}'
    assert call("POST", "/v1/completions", content=big).status_code == 413

    async def chunks():
        yield big[:40]
        yield big[40:]

    r = call("POST", "/v1/completions", content=chunks())  # no Content-Length: counted as it arrives
    assert r.status_code == 413
    assert "64-byte limit" in r.json()["error"]["message"]
