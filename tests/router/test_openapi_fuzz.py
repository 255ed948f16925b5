"""Schemathesis against the router's own /openapi.json, with the router a real process in front of one real
`tandem worker --model smollm2`: whatever the generated request (valid or not), no 5xx, and every 4xx carries
the OpenAI error body {"error": {"message", "type", "param", "code"}}.

Generation stays cheap: the worker's context is 128 tokens and the router caps max_tokens at 8, so a valid
request decodes at most 8 tokens (or gets a 400), and the example count per operation is bounded.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tandem.runtimes.launcher import ServiceProcess

EXAMPLES_PER_OPERATION = 20
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"),
              ("GET", "/health"), ("GET", "/ready"), ("HEAD", "/health"), ("HEAD", "/ready"), ("GET", "/metrics"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")]
# Error events inside an SSE stream that would mean the server, not the request, failed.
SERVER_ERROR_TYPES = {"server_error", "service_unavailable"}


@pytest.fixture(scope="module")
def router_url():
    worker = ServiceProcess(["worker", "--model", "smollm2", "--max-model-len", "128", "--kv-transfer", "tcp",
                             "--log-level", "warning"], name="fuzz-worker")
    router = None
    try:
        worker.start().wait_ready(240)
        router = ServiceProcess(["router", "--model", "smollm2", "--decode", worker.url, "--max-output-tokens", "8",
                                 "--log-level", "warning"], name="fuzz-router").start().wait_ready(120)
        # The router learns max_model_len from the worker's first load report; wait for it.
        yield router.url
        assert router.proc.poll() is None, f"the router died:\n{router.log_tail()}"
        assert worker.proc.poll() is None, f"the worker died ({worker.proc.returncode}):\n{worker.log_tail()}"
    finally:
        if router is not None:
            router.stop()
        worker.stop()


@pytest.fixture(scope="module")
def router_schema(router_url):
    return schemathesis.openapi.from_url(f"{router_url}/openapi.json")


def assert_openai_error(response, where: str) -> None:
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{where}: {response.status_code} without a JSON body: {response.text[:300]!r}")
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), f"{where}: {response.status_code} body is not an OpenAI error: {body!r}"
    assert isinstance(error.get("message"), str) and error["message"], f"{where}: no message in {body!r}"
    assert isinstance(error.get("type"), str) and error["type"], f"{where}: no type in {body!r}"
    assert "param" in error and "code" in error, f"{where}: param/code missing from {body!r}"


def assert_no_server_error_events(text: str, where: str) -> None:
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            error = event.get("error") if isinstance(event, dict) else None
            assert not (error and error.get("type") in SERVER_ERROR_TYPES), f"{where}: stream carried {event!r}"


@pytest.mark.parametrize(("method", "path", "mode"), [
    *[(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS],
    *[(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"],
], ids=lambda v: v.value if isinstance(v, GenerationMode) else v)
def test_router_answers_generated_requests_without_5xx(router_schema, router_url, method, path, mode):
    operation = router_schema.find_operation_by_path(method, path)
    statuses = []

    # derandomize: the same examples every run. Freshly random ones now and then held no servable request at all
    # (every one a 400), which failed the "reached the worker" check below by chance.
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def check(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "smollm2"  # else nearly every valid request stops at 404 model_not_found
        response = case.call(base_url=router_url, timeout=120)
        statuses.append(response.status_code)
        where = f"{case.method} {case.path} body={str(case.body)[:300]!r} headers={case.headers!r}"
        assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]!r}"
        if response.status_code >= 400:
            assert_openai_error(response, where)
        elif any(v.startswith("text/event-stream") for v in response.headers.get("content-type", [])):
            assert_no_server_error_events(response.text, where)

    check()
    if mode is GenerationMode.POSITIVE and method == "POST":  # the fuzzing reached the worker, not just validation
        assert 200 in statuses, f"no generated request was served: statuses {sorted(set(statuses))}"


def test_every_operation_is_fuzzed(router_schema):
    """A new endpoint must join OPERATIONS, or it would escape the fuzzing."""
    documented = {(op.ok().method.upper(), op.ok().path) for op in router_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


def test_the_schema_covers_the_openai_surface(router_url):
    """The fuzzing above is only as wide as the schema: it must document the endpoints clients use."""
    paths = httpx.get(f"{router_url}/openapi.json", timeout=10).json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        assert path in paths, f"{path} is missing from /openapi.json"
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "requestBody" in paths[path]["post"], f"{path} documents no request body"
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)), f"operation ids are not unique: {sorted(ids)}"  # client generators need them
