"""Fixtures: the emulated API server, and the real kopf operator running against it in its own thread."""

from __future__ import annotations

import asyncio
import logging
import threading

import kmock
import kubernetes.client
import pytest_asyncio
from kube_emulator import RESOURCES, VERBS, ApiServerEmulator, Cluster

from tandem.operator.main import operate


@pytest_asyncio.fixture
async def emulator():
    """An emulated API server on 127.0.0.1 that knows every resource the operator touches."""
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    async with ApiServerEmulator() as server, kmock.Server(server):
        for resource, (kind, namespaced, subresources) in RESOURCES.items():
            server.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                                            subresources=subresources)
        yield server


@pytest_asyncio.fixture
async def cluster(emulator):
    """The emulated API server with the operator watching namespace `ns1`; stopped afterwards.

    The operator gets its own thread and event loop, as in production: on exit kopf cancels every task
    of its loop, which must not include the emulator's or the test's.
    """
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(emulator.url).rstrip("/")))
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(operate("ns1", api_client=api, resync_seconds=None, stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # surfaced by the fixture, not lost in the thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 15), f"operator not ready in 15 s: {failure}"
        yield Cluster(emulator, "ns1")
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        api.close()
    assert not thread.is_alive(), "the operator did not stop within 15 s"
    assert not failure, f"the operator crashed: {failure[0]!r}"
