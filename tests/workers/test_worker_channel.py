"""The internal API multiplexed on one WebSocket (tandem.workers.channel) against a real `tandem worker`,
driven by the router's own client (tandem.router.worker_client), and that client's HTTP fallback."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web
from api_checks import metric, wait_for

from tandem.router import worker_client
from tandem.router.worker_channel import CorkedTransport
from tandem.router.worker_client import TRANSPORT_ERRORS, WorkerClient, WorkerStatusError
from tandem.runtimes.launcher import ServiceProcess, free_port

PROMPTS = [[504, 3575, 282, 4649, 314], [504, 3575, 282], [1274, 260, 2134, 28, 339, 5765]]


@pytest.fixture(scope="module")
def worker():
    proc = ServiceProcess(["worker", "--role", "both", "--model", "smollm2", "--num-kv-blocks", "128",
                           "--max-model-len", "1024"], name="channel-worker")
    with proc:
        yield proc


def decode_body(request_id: str, prompt: list[int], max_tokens: int = 8) -> dict:
    return {"request_id": request_id, "prompt_token_ids": prompt,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "logprobs": 1}}


async def collect(client: WorkerClient, url: str, body: dict) -> list[dict]:
    return [event async for batch in client.event_batches(url, "/internal/decode", body) for event in batch]


def outputs(events: list[dict]) -> list[tuple]:
    """What a decode stream says, less its prefix-cache counts (a repeated prompt hits the cache) and logprobs."""
    return [(e["token_ids"], e["text"], e.get("finish_reason")) for e in events]


def logprobs(events: list[dict]) -> list[float]:
    """Each token's logprob and its top logprobs, flat."""
    return [value for e in events for entry in e["logprobs"]
            for value in (entry["logprob"], *(lp for _, lp in entry["top_logprobs"]))]


def test_concurrent_requests_share_one_channel_and_get_their_own_streams(worker):
    async def run():
        channel_client, http_client = WorkerClient(), WorkerClient(transport="http")
        try:
            over_http = [await collect(http_client, worker.url, decode_body(f"http-{i}", p))
                         for i, p in enumerate(PROMPTS)]
            over_channel = await asyncio.gather(*(collect(channel_client, worker.url, decode_body(f"ws-{i}", p))
                                                  for i, p in enumerate(PROMPTS)))
            return over_http, over_channel, len(channel_client._channels)
        finally:
            await channel_client.close()
            await http_client.close()

    over_http, over_channel, channels = asyncio.run(run())
    assert channels == 1  # one connection carried the three requests at once
    assert [outputs(e) for e in over_channel] == [outputs(e) for e in over_http]
    # Batched together, not one at a time: the same greedy tokens, logprobs as close as the matmuls' float
    # rounding for another batch size leaves them (equal where the GGUF GEMV kernel computes each row alone).
    for channel_events, http_events in zip(over_channel, over_http):
        assert logprobs(channel_events) == pytest.approx(logprobs(http_events), rel=1e-4)
    assert all(sum(len(e["token_ids"]) for e in events) == 8 for events in over_channel)
    assert all(events[-1]["finish_reason"] == "length" for events in over_channel)


def test_a_refused_request_fails_alone_with_the_http_status(worker):
    async def run():
        client = WorkerClient()
        try:
            with pytest.raises(WorkerStatusError) as bad_token:
                await collect(client, worker.url, decode_body("bad", [504, 10**9]))
            with pytest.raises(WorkerStatusError) as bad_body:
                await client.post_json(worker.url, "/internal/abort", {"no_request_id": 1})
            with pytest.raises(WorkerStatusError) as unknown:
                await client.post_json(worker.url, "/internal/nothing", {})
            aborted = await client.post_json(worker.url, "/internal/abort", {"request_id": "never-sent"})
            after = await collect(client, worker.url, decode_body("after", PROMPTS[0], max_tokens=2))
            open_channels = [c for c in client._channels.values() if not c.closed]
            return bad_token.value, bad_body.value, unknown.value, aborted, after, open_channels
        finally:
            await client.close()

    bad_token, bad_body, unknown, aborted, after, channels = asyncio.run(run())
    assert bad_token.status == 400 and "outside the vocabulary" in bad_token.message
    assert bad_body.status == 400 and "request_id" in bad_body.message
    assert unknown.status == 404
    assert aborted == {"aborted": "never-sent"}
    assert sum(len(e["token_ids"]) for e in after) == 2  # the same channel still serves
    assert len(channels) == 1  # and it stayed open


def test_a_closed_channel_stops_its_requests_on_the_worker(worker):
    aborted_before = metric(worker, "tandem_requests_finished_total", 'finish_reason="abort"', default=0)

    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{worker.url}/internal/ws") as ws:
            body = decode_body("left-behind", PROMPTS[0], max_tokens=900)  # minutes of decoding on a CPU
            await ws.send_bytes(orjson.dumps({"id": 7, "path": "/internal/decode", "body": body}))
            first = orjson.loads((await ws.receive()).data)
            assert first["id"] == 7 and first["event"]["token_ids"]
        # leaving the block closed the connection after one token

    asyncio.run(run())
    assert wait_for(lambda: httpx.get(f"{worker.url}/internal/load").json()["in_flight"] == 0, timeout=20)
    assert metric(worker, "tandem_requests_finished_total", 'finish_reason="abort"') == aborted_before + 1


def test_a_message_id_already_in_flight_is_refused(worker):
    """An id is what a cancel names: a second request under an id in flight would leave the first uncancellable
    (found by a robustness helper). Refused; the first goes on and ends as usual."""
    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{worker.url}/internal/ws") as ws:
            await ws.send_bytes(orjson.dumps({"id": 42, "path": "/internal/decode",
                                              "body": decode_body("dup-first", PROMPTS[0], max_tokens=6)}))
            await ws.send_bytes(orjson.dumps({"id": 42, "path": "/internal/decode",
                                              "body": decode_body("dup-second", PROMPTS[1], max_tokens=2)}))
            answers = []
            while not any(a.get("done") for a in answers):
                answers.append(orjson.loads((await ws.receive()).data))
            return answers

    answers = asyncio.run(run())
    refused = [a for a in answers if a.get("status") == 400]
    assert len(refused) == 1 and "already in flight" in refused[0]["body"]["error"]["message"]
    tokens = [t for a in answers if "event" in a for t in a["event"].get("token_ids", [])]
    assert len(tokens) == 6  # the first request's, whole


def test_a_request_the_router_gives_up_on_is_cancelled_on_the_worker(worker):
    """The caller stops reading (its client left): the channel tells the worker, which stops the request as it
    stops an HTTP request whose client closed the connection; the channel itself stays open for the others."""
    aborted_before = metric(worker, "tandem_requests_finished_total", 'finish_reason="abort"', default=0)

    async def run():
        client = WorkerClient()
        try:
            batches = client.event_batches(worker.url, "/internal/decode", decode_body("given-up", PROMPTS[0], 900))
            first = await batches.__anext__()
            await batches.aclose()
            stopped = await asyncio.to_thread(
                wait_for, lambda: httpx.get(f"{worker.url}/internal/load").json()["in_flight"] == 0, 20)
            after = await collect(client, worker.url, decode_body("after-cancel", PROMPTS[1], max_tokens=2))
            return first, stopped, after, [c for c in client._channels.values() if not c.closed]
        finally:
            await client.close()

    first, stopped, after, channels = asyncio.run(run())
    assert first[0]["token_ids"] and stopped
    assert metric(worker, "tandem_requests_finished_total", 'finish_reason="abort"') == aborted_before + 1
    assert sum(len(e["token_ids"]) for e in after) == 2 and len(channels) == 1


async def serve_routes(port: int, *routes: web.RouteDef) -> web.AppRunner:
    """A small aiohttp server on 127.0.0.1:port standing in for a worker; cleanup() stops it."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def serve_http_only_worker(port: int) -> web.AppRunner:
    """An older worker: /internal/decode over HTTP (SSE) and no /internal/ws."""
    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"token_ids": [5], "text": "a"}\n\n')
        await response.write(b'data: {"token_ids": [6], "text": "b", "finish_reason": "length"}\n\ndata: [DONE]\n\n')
        return response

    return await serve_routes(port, web.post("/internal/decode", decode))


def test_a_worker_without_a_channel_is_served_over_http():
    async def run():
        port = free_port()
        runner = await serve_http_only_worker(port)
        client = WorkerClient()
        try:
            url = f"http://127.0.0.1:{port}"
            events = [await collect(client, url, decode_body(f"old-{i}", [1, 2])) for i in range(2)]
            return events, client._http_only, client._channels
        finally:
            await client.close()
            await runner.cleanup()

    events, http_only, channels = asyncio.run(run())
    assert events[0] == events[1] == [{"token_ids": [5], "text": "a"},
                                      {"token_ids": [6], "text": "b", "finish_reason": "length"}]
    assert len(http_only) == 1 and not channels


def test_an_answer_that_is_not_the_protocols_is_a_transport_error():
    """A worker (or something in front of it) that answers what no worker says, over HTTP or its channel: the
    router's transport error, the worker's failure, rather than a parse error that ends the client's request."""
    async def garbled_sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"token_ids": [5], "text": "a"}\n\ndata: {not json\n\n')
        return response

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html>bad gateway</html>", content_type="text/html")

    async def channel(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            call = orjson.loads(message.data)
            await ws.send_bytes(orjson.dumps({"id": call["id"], "body": [1, 2]}))  # JSON, but no object
        return ws

    async def run():
        http_port, ws_port = free_port(), free_port()
        runners = [await serve_routes(http_port, web.post("/internal/decode", garbled_sse),
                                      web.post("/internal/prefill", html)),
                   await serve_routes(ws_port, web.get("/internal/ws", channel))]
        client = WorkerClient()
        try:
            url = f"http://127.0.0.1:{http_port}"
            seen = []
            with pytest.raises(worker_client.UnreadableAnswer):
                async for batch in client.event_batches(url, "/internal/decode", decode_body("g", [1])):
                    seen.extend(batch)
            with pytest.raises(worker_client.UnreadableAnswer):
                await client.post_json(url, "/internal/prefill", {})
            with pytest.raises(worker_client.UnreadableAnswer):
                await client.post_json(f"http://127.0.0.1:{ws_port}", "/internal/prefill", {})
            return seen
        finally:
            await client.close()
            for runner in runners:
                await runner.cleanup()

    assert asyncio.run(run()) == [{"token_ids": [5], "text": "a"}]
    assert issubclass(worker_client.UnreadableAnswer, TRANSPORT_ERRORS)


def test_a_refusal_keeps_the_workers_error_code():
    error = worker_client._status_error(400, orjson.dumps({"error": {"message": "incompatible KV layout: dtype",
                                                                    "code": "kv_layout_mismatch"}}))
    assert (error.status, error.message, error.code) == (400, "incompatible KV layout: dtype", "kv_layout_mismatch")
    assert worker_client._status_error(502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"
    assert worker_client._status_error(400, {"error": "plain"}).message == "{'error': 'plain'}"


def test_a_request_the_worker_leaves_unanswered_times_out_as_a_transport_error():
    """A worker that keeps its channel open (and answers pings) but never answers one request: the request
    fails after the read timeout, as an HTTP read would, so the orchestrator can take it elsewhere."""
    heard: list[dict] = []

    async def silent(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:  # read, never answer
            heard.append(orjson.loads(message.data))
        return ws

    async def run():
        port = free_port()
        runner = await serve_routes(port, web.get("/internal/ws", silent))
        client = WorkerClient(read_timeout_s=0.4)
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(TRANSPORT_ERRORS) as caught:
                await collect(client, f"http://127.0.0.1:{port}", decode_body("unanswered", [1, 2]))
            waited = asyncio.get_running_loop().time() - started
            await asyncio.sleep(0.1)  # the cancel is sent on its way
            return caught.value, waited
        finally:
            await client.close()
            await runner.cleanup()

    error, waited = asyncio.run(run())
    assert isinstance(error, asyncio.TimeoutError)
    assert 0.4 <= waited < 5
    assert heard[1:] == [{"id": heard[0]["id"], "cancel": True}]  # the worker is told to stop it


def test_a_worker_that_refused_the_channel_is_asked_again_later(monkeypatch):
    """An upgrade refused (an older worker, or an ingress in front of it mid-rollout) is not final: once the
    retry interval has passed, a worker that now offers the channel gets it."""
    monkeypatch.setattr(worker_client, "NO_CHANNEL_RETRY_S", 0.2)

    async def run():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        client = WorkerClient()
        try:
            old = await serve_http_only_worker(port)
            over_http = await collect(client, url, decode_body("a", [1, 2]))
            await old.cleanup()
            await asyncio.sleep(0.25)
            return over_http, await collect_from_channel_worker(client, port, "upgraded", decode_body("b", [1, 2]))
        finally:
            await client.close()

    over_http, over_channel = asyncio.run(run())
    assert [e["text"] for e in over_http] == ["a", "b"]
    assert [e["text"] for e in over_channel] == ["upgraded"]


async def serve_channel_only_worker(port: int, name: str) -> web.AppRunner:
    """A worker reduced to its channel: every decode is one event naming the worker."""
    async def channel(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            call = orjson.loads(message.data)
            event = {"token_ids": [1], "text": name, "finish_reason": "length"}
            await ws.send_bytes(orjson.dumps({"id": call["id"], "event": event, "done": True}))
        return ws

    return await serve_routes(port, web.get("/internal/ws", channel))


async def collect_from_channel_worker(client: WorkerClient, port: int, name: str, body: dict) -> list[dict]:
    """A decode served by a fresh channel-only stand-in on `port`, stopped afterwards."""
    runner = await serve_channel_only_worker(port, name)
    try:
        return await collect(client, f"http://127.0.0.1:{port}", body)
    finally:
        await runner.cleanup()


def test_a_worker_restarted_at_the_same_address_gets_a_new_channel():
    async def run():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        client = WorkerClient()
        try:
            first = await serve_channel_only_worker(port, "first")
            before = await collect(client, url, decode_body("a", [1, 2]))
            await first.cleanup()  # the worker goes away: its channel closes
            for _ in range(100):
                if client._channels[url].closed:
                    break
                await asyncio.sleep(0.01)
            return before, await collect_from_channel_worker(client, port, "second", decode_body("b", [1, 2]))
        finally:
            await client.close()

    before, after = asyncio.run(run())
    assert [e["text"] for e in before] == ["first"] and [e["text"] for e in after] == ["second"]


def test_events_before_a_dropped_connection_reach_the_caller_before_the_error():
    """The worker sends two tokens and its connection drops: the caller gets both, then a transport error (the
    orchestrator resumes after them)."""
    async def two_then_gone(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        call = orjson.loads((await ws.receive()).data)
        for token in (5, 6):
            await ws.send_bytes(orjson.dumps({"id": call["id"], "event": {"token_ids": [token], "text": "x"}}))
        await ws.close()
        return ws

    async def run():
        port = free_port()
        runner = await serve_routes(port, web.get("/internal/ws", two_then_gone))
        client = WorkerClient()
        received = []
        try:
            with pytest.raises(TRANSPORT_ERRORS):
                async for batch in client.event_batches(f"http://127.0.0.1:{port}", "/internal/decode", {}):
                    received += [event["token_ids"] for event in batch]
            return received
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(run()) == [[5], [6]]


def test_a_worker_that_is_down_raises_a_transport_error():
    async def run():
        client = WorkerClient()
        try:
            await collect(client, f"http://127.0.0.1:{free_port()}", decode_body("nobody", [1, 2]))
        finally:
            await client.close()

    with pytest.raises(TRANSPORT_ERRORS):
        asyncio.run(run())


def test_frames_written_in_one_pass_of_the_loop_leave_in_one_write():
    class Transport:
        def __init__(self):
            self.writes, self.closing = [], False

        def write(self, data):
            self.writes.append(bytes(data))

        def is_closing(self):
            return self.closing

    async def run():
        inner, busy = Transport(), [False]
        corked = CorkedTransport(inner, lambda: busy[0])
        corked.write(b"alone")  # no other request in flight: at once
        assert inner.writes == [b"alone"]
        inner.writes.clear()
        busy[0] = True
        corked.write(b"a")
        corked.write(bytearray(b"b"))  # aiohttp writes a masked frame as a bytearray
        assert inner.writes == [] and corked.is_closing() is False  # not yet; the rest is the transport's
        await asyncio.sleep(0)
        assert inner.writes == [b"ab"]
        corked.write(b"c")
        inner.closing = True
        await asyncio.sleep(0)
        assert inner.writes == [b"ab"]  # a closing transport takes nothing more

    asyncio.run(run())


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_a_dropped_worker_fails_the_requests_waiting_on_it_and_spares_the_others(transport):
    """A worker that sent one token and then hung (its connection open, nothing more coming): drop() fails the
    requests on it at once with a transport error (the orchestrator resumes them elsewhere), after the token
    that did arrive. A request on another worker goes on."""
    async def one_token_then_hang_ws(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            call = orjson.loads(message.data)
            if "path" in call:
                await ws.send_bytes(orjson.dumps({"id": call["id"], "event": {"token_ids": [5], "text": "x"}}))
        return ws

    async def one_token_then_hang_http(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"token_ids": [5], "text": "x"}\n\n')
        await asyncio.sleep(3600)
        return response

    async def run():
        hung_port, other_port = free_port(), free_port()
        runners = [await serve_routes(port, web.get("/internal/ws", one_token_then_hang_ws),
                                      web.post("/internal/decode", one_token_then_hang_http))
                   for port in (hung_port, other_port)]
        client = WorkerClient(transport=transport)
        hung, other = f"http://127.0.0.1:{hung_port}", f"http://127.0.0.1:{other_port}"

        async def tokens_then_error(url: str):
            received = []
            try:
                async for batch in client.event_batches(url, "/internal/decode", decode_body("r", [1, 2])):
                    received += [event["token_ids"] for event in batch]
            except TRANSPORT_ERRORS as exc:
                return received, exc
            return received, None

        try:
            on_hung = asyncio.create_task(tokens_then_error(hung))
            on_other = asyncio.create_task(tokens_then_error(other))
            await asyncio.sleep(0.5)  # both have their first token and wait for more
            client.drop(hung)
            received, error = await asyncio.wait_for(on_hung, 5)
            await asyncio.sleep(0.2)
            return received, error, on_other.done()
        finally:
            on_other.cancel()
            await client.close()
            for runner in runners:
                await runner.cleanup()

    received, error, other_done = asyncio.run(run())
    assert received == [[5]] and isinstance(error, TRANSPORT_ERRORS)
    assert not other_done  # its worker was not dropped: it still waits


def test_a_callers_own_cancel_landing_with_a_drop_stays_a_cancel():
    """The client leaves (its request's task is cancelled) in the same pass of the loop as its worker is dropped:
    the request ends cancelled, not with the transport error that would send it to another worker."""
    async def run():
        client = WorkerClient(transport="http")
        outcome = []

        async def request():
            try:
                with client._waiting_on("http://w"):
                    await asyncio.sleep(10)  # stands for the wait for the worker's answer
            except TRANSPORT_ERRORS:
                outcome.append("transport error: would be retried elsewhere")

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        client.drop("http://w")
        task.cancel()
        await asyncio.sleep(0.05)
        return outcome, task.cancelled()

    assert asyncio.run(run()) == ([], True)


async def serve_stand_in_prefill_worker(port: int, released: list[str], agent_asked: asyncio.Event,
                                        agent_delay_s: float, agent_asks: list | None = None) -> web.AppRunner:
    """A prefill worker reduced to what a decode worker calls on it: its KV agent (answered after `agent_delay_s`;
    each request counted in `agent_asks`) and lease release (recorded)."""
    async def agent(request: web.Request) -> web.Response:
        agent_asked.set()
        if agent_asks is not None:
            agent_asks.append(request.path)
        await asyncio.sleep(agent_delay_s)
        return web.json_response({"agent": {"agent_name": "stand-in"}})

    async def release(request: web.Request) -> web.Response:
        released.append((await request.json())["lease_id"])
        return web.json_response({})

    return await serve_routes(port, web.get("/internal/kv/agent", agent), web.post("/internal/kv/release", release))


def pulled_decode_body(request_id: str, prefill_url: str, layout: dict, lease_id: str, **handle_changes) -> dict:
    prompt = PROMPTS[1]
    handle = {"source_url": prefill_url, "agent_name": "stand-in", "lease_id": lease_id, "block_ids": [0],
              "num_tokens": len(prompt), "layout": layout, "expires_at": 4e9, **handle_changes}
    return {**decode_body(request_id, prompt), "kv_handle": handle, "first_token_id": 5}


async def give_up_while_the_agent_is_asked(client: WorkerClient, worker_url: str, agent_asked: asyncio.Event,
                                           body: dict) -> None:
    """Sends a decode with a KV handle and gives up on it (its client left) while the decode worker is asking the
    prefill worker for its agent: the channel tells the worker to stop the request."""
    batches = client.event_batches(worker_url, "/internal/decode", body)
    first = asyncio.get_running_loop().create_task(anext(batches))
    await asyncio.wait_for(agent_asked.wait(), 20)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await batches.aclose()


def test_a_decode_given_up_on_while_it_waits_for_the_prefill_worker_frees_the_prompt_blocks_at_once(worker):
    """The router gives up on a disaggregated request (its client left) while the decode worker is still asking
    the prefill worker for its KV agent: nothing will read the prompt's blocks, which must be freed now, not
    pinned on the prefill worker until the lease expires. A decode refused before it begins frees them too."""
    layout = httpx.get(f"{worker.url}/internal/kv/agent").json()["layout"]

    async def run():
        port, released, agent_asked = free_port(), [], asyncio.Event()
        prefill_url = f"http://127.0.0.1:{port}"
        runner = await serve_stand_in_prefill_worker(port, released, agent_asked, agent_delay_s=30)
        client = WorkerClient()
        try:
            await give_up_while_the_agent_is_asked(client, worker.url, agent_asked,
                                                   pulled_decode_body("pd-left", prefill_url, layout, "lease-left"))
            for _ in range(100):
                if released:
                    break
                await asyncio.sleep(0.05)
            left = list(released)
            with pytest.raises(WorkerStatusError) as refused:
                await collect(client, worker.url, pulled_decode_body("pd-bad", prefill_url, layout, "lease-bad",
                                                                     num_tokens=99))
            for _ in range(100):
                if len(released) > 1:
                    break
                await asyncio.sleep(0.05)
            return left, refused.value, released
        finally:
            await client.close()
            await runner.cleanup()

    left, refused, released = asyncio.run(run())
    assert left == ["lease-left"]  # well before the 30 s the agent takes
    assert refused.status == 400 and "kv_handle covers 99 tokens" in refused.message
    assert released == ["lease-left", "lease-bad"]


def test_an_agent_fetch_cut_short_by_a_cancel_still_fills_the_cache(worker):
    """The fetch of a prefill worker's KV agent goes on when the request waiting for it is cancelled: the next
    request with a handle from that worker finds the agent known, instead of waiting for it again."""
    layout = httpx.get(f"{worker.url}/internal/kv/agent").json()["layout"]

    async def run():
        port, released, agent_asked, asks = free_port(), [], asyncio.Event(), []
        prefill_url = f"http://127.0.0.1:{port}"
        runner = await serve_stand_in_prefill_worker(port, released, agent_asked, agent_delay_s=0.5, agent_asks=asks)
        client = WorkerClient()
        try:
            await give_up_while_the_agent_is_asked(client, worker.url, agent_asked,
                                                   pulled_decode_body("agent-1", prefill_url, layout, "lease-1"))
            await asyncio.sleep(1.0)  # the fetch's answer comes meanwhile
            # The stand-in's agent cannot serve a pull: the decode computes the prompt itself, as on any failed pull.
            events = await collect(client, worker.url, pulled_decode_body("agent-2", prefill_url, layout, "lease-2"))
            return asks, events, released
        finally:
            await client.close()
            await runner.cleanup()

    asks, events, released = asyncio.run(run())
    assert asks == ["/internal/kv/agent"]  # asked once, for both requests
    # The prefill's first token counts as made: the decode makes the other 7 of max_tokens 8.
    assert sum(len(e["token_ids"]) for e in events) == 7 and events[-1]["finish_reason"] == "length"
    assert "lease-1" in released


def test_a_request_cancelled_before_its_task_ran_still_runs_its_own_cleanup():
    """A call and its cancel read together (the router corks its writes): the task answering the call has not run
    yet when the cancel comes. Cancelled outright, its coroutine would never start, and a decode would never
    release its prefill lease; cancelled once started, its cleanup runs."""
    from tandem.workers.channel import cancel_once_started

    async def run(cancel) -> tuple[list[str], bool]:
        cleaned: list[str] = []

        async def handler():
            try:
                await asyncio.sleep(30)
            finally:
                cleaned.append("released")

        task = asyncio.get_running_loop().create_task(handler())
        cancel(task)
        await asyncio.gather(task, return_exceptions=True)
        return cleaned, task.cancelled()

    assert asyncio.run(run(cancel_once_started)) == (["released"], True)
    assert asyncio.run(run(asyncio.Task.cancel)) == ([], True)  # what an outright cancel does


def test_a_channel_dropped_before_its_reader_ran_is_closed_and_replaced(monkeypatch):
    """drop() can come in the same pass of the loop as the connect that made the channel (a probe's step already
    queued), before the channel's reader has run: a task cancelled before its first step never runs its cleanup,
    so the channel must close itself out. Otherwise it stays 'open' and unread, and every later request to that
    worker waits for the read timeout, until the router restarts."""
    from tandem.router import worker_channel

    async def run():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        runner = await serve_channel_only_worker(port, "answered")
        client = WorkerClient(read_timeout_s=3.0)
        real_init = worker_channel.WorkerChannel.__init__

        def init(self, ws, read_timeout_s, on_notice=None):
            asyncio.get_running_loop().call_soon(client.drop, url)  # queued ahead of the reader's first step
            real_init(self, ws, read_timeout_s, on_notice)

        try:
            monkeypatch.setattr(worker_channel.WorkerChannel, "__init__", init)
            dropped = await client._channel(url)
            monkeypatch.setattr(worker_channel.WorkerChannel, "__init__", real_init)
            await asyncio.sleep(0.05)
            started = asyncio.get_running_loop().time()
            events = await collect(client, url, decode_body("after-drop", [1, 2]))
            waited = asyncio.get_running_loop().time() - started
            return dropped, events, waited, client._channels[url]
        finally:
            await asyncio.wait_for(client.close(), 5)  # an aborted reader does not fail the close
            await runner.cleanup()

    dropped, events, waited, current = asyncio.run(run())
    assert dropped.closed and dropped.ws.closed and dropped._watchdog.cancelled()
    assert current is not dropped  # a new channel was opened for the next request
    assert [e["text"] for e in events] == ["answered"] and waited < 2
