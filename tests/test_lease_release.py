"""A decode worker's lease release reaches the prefill worker even when the first try fails on the way."""

import asyncio
from types import SimpleNamespace

import httpx

from tandem.workers.internal_api import release_lease


def test_a_release_lost_on_a_closed_connection_is_sent_again():
    """The first request's connection is closed with no answer (as a server closing an idle keep-alive
    connection just as it is reused); the release must still arrive."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        received.append(await reader.readexactly(length))
        if len(received) > 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
            await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient() as http:
            handle = SimpleNamespace(source_url=f"http://127.0.0.1:{port}", lease_id="lease-1")
            await release_lease(SimpleNamespace(http=http), handle)

    asyncio.run(run())
    assert received == [b'{"lease_id":"lease-1"}'] * 2
