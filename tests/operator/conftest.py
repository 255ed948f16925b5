"""Fixtures: the emulated API server, and the real kopf operator running against it in its own thread."""

from __future__ import annotations

import logging

import kmock
import pytest_asyncio
from kube_emulator import RESOURCES, VERBS, ApiServerEmulator, running_operator


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
    """The emulated API server with the operator watching namespace `ns1`; stopped afterwards."""
    async with running_operator(emulator) as running:
        yield running
