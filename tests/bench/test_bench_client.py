"""The bench client's stream parsing and timing, against scripted in-process servers (no model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tandem.bench.client import RequestRecord, request_body, send_streaming


def sse(*events) -> list[bytes]:
    return [f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n".encode() for e in events]


class SlowStream(httpx.AsyncByteStream):
    """Yields SSE events with a pause before each, like a server producing tokens."""

    def __init__(self, chunks: list[bytes], pause_s: float):
        self.chunks, self.pause_s = chunks, pause_s

    async def __aiter__(self):
        for chunk in self.chunks:
            await asyncio.sleep(self.pause_s)
            yield chunk


def run(handler, endpoint, body) -> RequestRecord:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            record = RequestRecord(point=0, index=0, warmup=False, input_tokens=4, output_tokens=3)
            return await send_streaming(client, "http://test", endpoint, body, record, time.perf_counter())

    return asyncio.run(go())


def chat_chunk(content=None, role=None, finish=None):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_chat_stream_timings_skip_the_role_chunk_and_read_usage():
    seen = {}

    def handler(request: httpx.Request):
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        events = [chat_chunk("", role="assistant"), chat_chunk("Hi"), chat_chunk(" there"), chat_chunk("!"),
                  chat_chunk(finish="length"),
                  {"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 3}}, "[DONE]"]
        return httpx.Response(200, stream=SlowStream(sse(*events), 0.02))

    body = request_body("chat", "m", "hello there you", 3, ignore_eos=True)
    r = run(handler, "chat", body)
    assert seen["path"] == "/v1/chat/completions"
    assert seen["body"]["messages"] == [{"role": "user", "content": "hello there you"}]
    assert seen["body"]["ignore_eos"] is True and seen["body"]["stream_options"] == {"include_usage": True}
    assert r.ok and r.error is None
    assert (r.prompt_tokens, r.completion_tokens) == (31, 3)
    assert len(r.itl_s) == 2  # three text chunks, two gaps; the role-only chunk is not a token
    assert r.ttft_s >= 0.035  # the role chunk came at ~20 ms, the first text at ~40 ms
    assert all(g >= 0.015 for g in r.itl_s)
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 2)
    assert r.finished_s >= r.start_s + r.e2e_s - 1e-6


def test_completions_without_usage_count_chunks():
    def handler(request):
        events = [{"choices": [{"text": t}]} for t in ("a", "b", "c", "d")] + ["[DONE]"]
        return httpx.Response(200, stream=SlowStream(sse(*events), 0.0))

    r = run(handler, "completions", request_body("completions", "m", [1, 2, 3], 4, ignore_eos=False))
    assert r.ok and r.completion_tokens == 4 and len(r.itl_s) == 3


def test_errors_are_recorded_not_raised():
    def refuse(request):
        return httpx.Response(429, json={"error": {"message": "queue full"}})

    r = run(refuse, "completions", request_body("completions", "m", [1], 2, False))
    assert not r.ok and r.status == 429 and "HTTP 429" in r.error and "queue full" in r.error

    def broken(request):
        return httpx.Response(200, stream=SlowStream(sse({"error": {"message": "engine died"}}, "[DONE]"), 0))

    r = run(broken, "completions", request_body("completions", "m", [1], 2, False))
    assert not r.ok and "engine died" in r.error

    def empty(request):
        return httpx.Response(200, stream=SlowStream(sse("[DONE]"), 0))

    r = run(empty, "completions", request_body("completions", "m", [1], 2, False))
    assert not r.ok and r.error == "the stream carried no text"

    def unreachable(request):
        raise httpx.ConnectError("connection refused")

    r = run(unreachable, "completions", request_body("completions", "m", [1], 2, False))
    assert not r.ok and "ConnectError" in r.error and r.finished_s is not None


def test_chat_refuses_token_id_prompts():
    with pytest.raises(ValueError, match="text prompt"):
        request_body("chat", "m", [1, 2, 3], 4, ignore_eos=False)
    assert "ignore_eos" not in request_body("completions", "m", [1], 4, ignore_eos=False)


def test_a_sweep_against_no_server_stops_before_it_starts(tmp_path, capsys):
    """Found by a newcomer's walkthrough: the whole sweep ran, every request failed, and results were written."""
    from tandem.bench.command import run_bench_command
    from tandem.bench.config import BenchConfig
    from tandem.runtimes.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"
    for model in (None, "smollm2"):
        config = BenchConfig(url=url, model=model, out=str(tmp_path / "out"), requests=2, concurrency=[1])
        assert run_bench_command(config) == 2
        assert f"nothing answers at {url}" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_an_sdk_base_url_ending_in_v1_is_taken():
    """Found by a newcomer's walkthrough: `--url http://.../v1` (the SDKs' base URL, as the README writes it) asked
    for /v1/v1/models, and with --model every request was a 404."""
    from tandem.bench.config import BenchConfig

    for url in ("http://127.0.0.1:18300/v1", "http://127.0.0.1:18300/v1/", "http://127.0.0.1:18300/"):
        assert BenchConfig(url=url).url == "http://127.0.0.1:18300"
    assert BenchConfig(url="http://host/api/v1").url == "http://host/api"
    assert BenchConfig(url="http://host/v10").url == "http://host/v10"
    assert BenchConfig(url="http://v1").url == "http://v1"  # a host named v1 is no path (a review helper's case)


def test_a_model_the_server_does_not_serve_stops_before_the_sweep(tmp_path, capsys, monkeypatch):
    """Found by a newcomer's walkthrough: `--model gpt-4` sent every request (all 404) and wrote the files of an
    all-failed run."""
    from tandem.bench.command import run_bench_command
    from tandem.bench.config import BenchConfig

    async def serves_smollm2(client, url):
        return {"models": ["smollm2"], "model": "smollm2", "owned_by": "tandem", "max_model_len": 8192}

    def sent(*args, **kwargs):
        raise AssertionError("a request was sent")

    monkeypatch.setattr("tandem.bench.loadgen.server_info", serves_smollm2)
    monkeypatch.setattr("tandem.bench.loadgen.send_streaming", sent)
    config = BenchConfig(url="http://127.0.0.1:18300", model="gpt-4", out=str(tmp_path / "out"), requests=2)
    assert run_bench_command(config) == 2
    assert capsys.readouterr().err.strip() == ("tandem bench: error: http://127.0.0.1:18300 does not serve "
                                               "--model 'gpt-4'; it serves: smollm2")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, said", [(None, "requires an API key"), ("sk-wrong", "refused the API key")])
def test_a_router_that_refuses_the_key_is_said_so(tmp_path, capsys, monkeypatch, key, said):
    """Found by a new user: against a router that requires a key, bench said it could not list the models and to
    name one with --model, hiding the 401."""
    import httpx

    from tandem.bench.command import run_bench_command
    from tandem.bench.config import BenchConfig

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    def router(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer sk-right":
            return httpx.Response(401, json={"error": {"message": "invalid API key", "type": "invalid_request_error"}})
        return httpx.Response(200, json={"data": [{"id": "smollm2"}]})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(router), **kw))
    config = BenchConfig(url="http://127.0.0.1:18300", api_key=key, out=str(tmp_path / "out"), requests=2)
    assert run_bench_command(config) == 2
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:18300 {said} (HTTP 401 on GET /v1/models)" in err and "--api-key" in err, err
    assert "name one with --model" not in err
