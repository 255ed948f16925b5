"""Scale-down drain: a draining worker leaves rotation but finishes every request it already has."""

import contextlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai

from tandem.runtimes.launcher import ServiceProcess


def test_drain_stops_readiness_and_waits_for_requests_in_flight():
    with ServiceProcess(["worker", "--model", "smollm2", "--num-kv-blocks", "128"], name="drain-worker") as worker:
        client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        pieces: list[str] = []
        started = threading.Event()

        def stream():
            for chunk in client.completions.create(model="smollm2", prompt="Count: one, two,", max_tokens=48,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        drain = subprocess.run([sys.executable, "-m", "tandem.cli", "drain", "--url", worker.url, "--timeout", "60"],
                               capture_output=True, text=True, timeout=90, env={"PYTHONSAFEPATH": "1"})
        assert drain.returncode == 0 and "is idle" in drain.stdout, drain.stdout + drain.stderr
        t.join(60)
        assert httpx.get(worker.url + "/ready").status_code == 503  # routers take it out of rotation
        assert httpx.head(worker.url + "/ready").status_code == 503
        usage = client.completions.create(model="smollm2", prompt="x", max_tokens=2)  # still answers if asked
        assert usage.choices[0].text is not None
        assert len("".join(pieces)) > 0 and len(pieces) >= 40  # the in-flight stream ran to its end


@contextlib.contextmanager
def _answering(status: int):
    """A server that answers every POST with `status`: not a worker."""
    class Answer(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_drain_of_something_that_is_not_a_worker_says_so_and_fails(capsys):
    """Found by a newcomer's walkthrough: `tandem drain --url <the router>` printed httpx's text and its MDN link,
    and exited 0 as if it had drained."""
    from tandem.runtimes.drain import drain

    with _answering(404) as url:
        assert drain(url, timeout_s=1) == 1
    said = capsys.readouterr()
    assert said.err.strip() == (f"tandem drain: {url} is not a Tandem worker (it has no /internal/drain route: "
                                "404); nothing was drained")
    with _answering(500) as url:  # any other refusal: as before, nothing to wait for, without httpx's boilerplate
        assert drain(url, timeout_s=1) == 0
    said = capsys.readouterr().out
    assert "did not accept the drain (Server error '500 Internal Server Error'" in said
    assert "mozilla" not in said and "For more information" not in said


def test_a_draining_worker_tells_the_routers_on_its_channel_at_once():
    """A router learns of the drain from the worker's channel, not at its next probe (seconds later): the worker
    leaves its rotation before another request is placed there."""
    import asyncio

    from tandem.metrics import RouterMetrics
    from tandem.router.pool import Worker, WorkerPool
    from tandem.router.worker_client import WorkerClient
    from tandem.server.internal_auth import internal_headers

    with ServiceProcess(["worker", "--model", "smollm2", "--num-kv-blocks", "64"], name="drain-notice") as worker:
        async def scenario() -> None:
            pool = WorkerPool("decode", None, RouterMetrics("drain_notice"))
            pool.workers[worker.url] = Worker(worker.url, healthy=True)
            pool.ring.add(worker.url)
            heard = asyncio.Event()
            client = WorkerClient()

            def notice(url: str, what: str) -> None:
                assert (url, what) == (worker.url, "draining")
                pool.leave_rotation(url, "it is draining")
                heard.set()

            client.on_notice = notice
            try:
                await client.post_json(worker.url, "/internal/abort", {"request_id": "none"})  # opens the channel
                async with httpx.AsyncClient(headers=internal_headers()) as http:
                    assert (await http.post(worker.url + "/internal/drain")).status_code == 200
                await asyncio.wait_for(heard.wait(), 10)
            finally:
                await client.close()
                assert not pool.workers[worker.url].healthy and worker.url not in pool.ring

        asyncio.run(scenario())  # no probe runs here: only the notice takes the worker out
