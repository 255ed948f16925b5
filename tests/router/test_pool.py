"""A worker's health as the pool's probes see it: one that does not answer at all (hung, or its host cut off) has
the requests in flight on it failed, once; one that answers "not ready" (draining) keeps them."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from aiohttp import web
from metric_values import metric_value

from tandem.metrics import RouterMetrics
from tandem.router.pool import WorkerPool, probe_pools
from tandem.runtimes.launcher import free_port


async def probed_worker(port: int, ready: bool) -> web.AppRunner:
    """A worker as the pool's probes see it: its load, and /ready answering 200, or 503 (draining)."""
    async def load(_):
        return web.json_response({"free_blocks": 1, "total_blocks": 1, "running": 1, "waiting": 0,
                                  "max_num_seqs": 256})

    async def readiness(_):
        if ready:
            return web.json_response({"status": "ready"})
        return web.json_response({"error": {"message": "draining"}}, status=503)

    app = web.Application()
    app.add_routes([web.get("/internal/load", load), web.get("/ready", readiness)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_only_a_worker_that_stops_answering_loses_its_requests_and_once():
    hung = socket.socket()  # the kernel accepts connections on its behalf; nothing ever answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    draining_port = free_port()
    runner = await probed_worker(draining_port, ready=False)
    hung_url, draining_url = f"http://127.0.0.1:{hung.getsockname()[1]}", f"http://127.0.0.1:{draining_port}"
    dropped: list[str] = []
    try:
        async with httpx.AsyncClient() as http:
            pool = WorkerPool("decode", http, RouterMetrics("test"), silent_after=2, on_silent=dropped.append)
            pool.set_members([hung_url, draining_url])
            rounds = []
            for _ in range(4):
                await probe_pools([pool], timeout_s=0.2)
                rounds.append(list(dropped))
    finally:
        hung.close()
        await runner.cleanup()
    assert rounds == [[], [hung_url], [hung_url], [hung_url]]  # at the second silent probe, and only then
    assert not pool.healthy()  # both are out of rotation all the same


async def test_when_no_worker_answers_and_the_router_was_held_up_the_silence_is_not_theirs():
    """Every probe of a round timing out while this router's event loop was held up says more about the router than
    about the workers: nothing is failed."""
    hung = [socket.socket() for _ in range(2)]
    for s in hung:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
    dropped: list[str] = []

    async def hold_up_the_loop():
        await asyncio.sleep(0.01)
        time.sleep(0.4)  # blocking: every timer of the loop runs late, the probes' timeouts too

    try:
        async with httpx.AsyncClient() as http:
            pool = WorkerPool("decode", http, RouterMetrics("test"), silent_after=2, on_silent=dropped.append)
            pool.set_members([f"http://127.0.0.1:{s.getsockname()[1]}" for s in hung])
            for _ in range(3):
                await asyncio.gather(probe_pools([pool], timeout_s=0.2), hold_up_the_loop())
    finally:
        for s in hung:
            s.close()
    assert dropped == []


async def test_a_lone_hung_worker_loses_its_requests_when_the_router_kept_time():
    """The only worker of its pool hangs: the other pool answering (or, with no other, this router's loop keeping
    time through the round) says the silence is the worker's."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    draining_port = free_port()
    runner = await probed_worker(draining_port, ready=False)
    dropped: list[str] = []
    try:
        async with httpx.AsyncClient() as http:
            prefill = WorkerPool("prefill", http, RouterMetrics("test"), silent_after=2, on_silent=dropped.append)
            prefill.set_members([hung_url])
            decode = WorkerPool("decode", http, RouterMetrics("test2"), silent_after=2, on_silent=dropped.append)
            decode.set_members([f"http://127.0.0.1:{draining_port}"])
            for _ in range(2):
                await probe_pools([prefill, decode], timeout_s=0.2)
            assert dropped == [hung_url]
            dropped.clear()
            alone = WorkerPool("decode", http, RouterMetrics("test3"), silent_after=2, on_silent=dropped.append)
            alone.set_members([hung_url])
            for _ in range(2):  # a longer timeout: a loaded machine's hiccup must not pass for a held-up loop
                await probe_pools([alone], timeout_s=1.0)
            assert dropped == [hung_url]
    finally:
        hung.close()
        await runner.cleanup()


async def test_a_worker_that_keeps_failing_requests_but_passes_its_probes_is_held_out_longer_each_time():
    ports = [free_port(), free_port()]
    runners = [await probed_worker(port, ready=True) for port in ports]
    url, other = (f"http://127.0.0.1:{port}" for port in ports)
    metrics = RouterMetrics("test-eject")
    loop = asyncio.get_running_loop()
    try:
        async with httpx.AsyncClient() as http:
            pool = WorkerPool("prefill", http, metrics, eject_after=3)
            pool.set_members([url, other])
            await probe_pools([pool], timeout_s=1.0)
            assert len(pool.healthy()) == 2
            for _ in range(3):
                pool.record_failure(url)
            assert [w.url for w in pool.healthy()] == [other]
            await probe_pools([pool], timeout_s=1.0)
            assert [w.url for w in pool.healthy()] == [other]  # ready, but held out: its next requests would fail
            await asyncio.sleep(pool.workers[url].held_out_until - loop.time() + 0.05)
            await probe_pools([pool], timeout_s=1.0)
            assert len(pool.healthy()) == 2  # 1 s after the first ejection
            for _ in range(3):
                pool.record_failure(url)
            assert pool.workers[url].held_out_until - loop.time() == pytest.approx(2.0, abs=0.2)  # doubled
            pool.record_success(url)  # it served a request (one in flight before): the next ejection starts over
            assert pool.workers[url].ejections == 0
            for _ in range(3):
                pool.record_failure(other)  # the other fails too: nothing would be left in rotation
            await probe_pools([pool], timeout_s=1.0)
            assert len(pool.healthy()) == 1  # the first to pass a probe is taken back at once: a 503 helps no one
    finally:
        for runner in runners:
            await runner.cleanup()
    assert metric_value(metrics.registry, "tandem_router_worker_ejections_total", worker=url) == 2


async def test_a_worker_discovery_drops_leaves_no_series_behind():
    """Pods come and go (scaling, restarts): the router's per-worker series of one that left must go with it, or
    every scrape and the dashboards' per-worker panels keep every worker there ever was."""
    ports = [free_port(), free_port()]
    runners = [await probed_worker(port, ready=True) for port in ports]
    gone, kept = (f"http://127.0.0.1:{port}" for port in ports)
    metrics = RouterMetrics("test-forget")
    try:
        async with httpx.AsyncClient() as http:
            pool = WorkerPool("decode", http, metrics, eject_after=1)
            pool.set_members([gone, kept])
            await probe_pools([pool], timeout_s=1.0)
            pool.record_failure(gone)  # an ejection: its counter has a series too
            pool.set_members([kept])
            await probe_pools([pool], timeout_s=1.0)
    finally:
        for runner in runners:
            await runner.cleanup()
    workers = {s.labels.get("worker") for family in metrics.registry.collect() for s in family.samples}
    assert gone not in workers and kept in workers
    assert metric_value(metrics.registry, "tandem_router_worker_healthy", worker=kept) == 1


async def test_a_worker_gone_with_nothing_in_flight_is_not_warned_of(caplog):
    """A worker that stopped as asked (drained, scaled away) stops answering too: with none of this router's
    requests on it, that is said at INFO; a warning is for one that takes requests with it."""
    gone = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens: refused
    async with httpx.AsyncClient() as http:
        pool = WorkerPool("decode", http, RouterMetrics("test"), silent_after=2, on_silent=lambda url: None)
        pool.set_members(gone)
        pool.workers[gone[1]].in_flight = 3
        with caplog.at_level("INFO", logger="tandem.router.pool"):
            for _ in range(2):
                await probe_pools([pool], timeout_s=0.2)
    said = {(r.levelname, r.getMessage().split()[2]) for r in caplog.records if "has not answered" in r.getMessage()}
    assert said == {("INFO", gone[0]), ("WARNING", gone[1])}


async def test_a_probe_reads_the_batch_a_worker_is_set_up_for():
    """The sequence valve's floor is an eighth of it (router.policies.cache_aware.CacheAware.sequence_floor)."""
    port = free_port()
    runner = await probed_worker(port, ready=True)
    try:
        async with httpx.AsyncClient() as http:
            pool = WorkerPool("decode", http, RouterMetrics("test"))
            pool.set_members([f"http://127.0.0.1:{port}"])
            await probe_pools([pool], timeout_s=2.0)
    finally:
        await runner.cleanup()
    (worker,) = pool.healthy()
    assert worker.max_num_seqs == 256 and worker.running == 1
