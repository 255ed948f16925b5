"""A worker's health as the pool's probes see it: one that does not answer at all (hung, or its host cut off) has
the requests in flight on it failed, once; one that answers "not ready" (draining) keeps them."""

from __future__ import annotations

import asyncio
import socket

import httpx
from aiohttp import web

from tandem.launcher import free_port
from tandem.metrics import RouterMetrics
from tandem.router.pool import WorkerPool


async def draining_worker(port: int) -> web.AppRunner:
    async def load(_):
        return web.json_response({"free_blocks": 1, "total_blocks": 1, "running": 1, "waiting": 0})

    async def not_ready(_):
        return web.json_response({"error": {"message": "draining"}}, status=503)

    app = web.Application()
    app.add_routes([web.get("/internal/load", load), web.get("/ready", not_ready)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_only_a_worker_that_stops_answering_loses_its_requests_and_once():
    hung = socket.socket()  # the kernel accepts connections on its behalf; nothing ever answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    draining_port = free_port()
    runner = await draining_worker(draining_port)
    hung_url, draining_url = f"http://127.0.0.1:{hung.getsockname()[1]}", f"http://127.0.0.1:{draining_port}"
    dropped: list[str] = []
    try:
        async with httpx.AsyncClient() as http:
            pool = WorkerPool("decode", http, RouterMetrics("test"), silent_after=2, on_silent=dropped.append)
            pool.set_members([hung_url, draining_url])
            rounds = []
            for _ in range(4):
                await asyncio.gather(*(pool.probe(w, timeout_s=0.2) for w in pool.workers.values()))
                rounds.append(list(dropped))
    finally:
        hung.close()
        await runner.cleanup()
    assert rounds == [[], [hung_url], [hung_url], [hung_url]]  # at the second silent probe, and only then
    assert not pool.healthy()  # both are out of rotation all the same
