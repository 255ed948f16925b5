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

    async def run(after_read: bool):
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient() as http:
            handle = SimpleNamespace(source_url=f"http://127.0.0.1:{port}", lease_id="lease-1")
            return await release_lease(SimpleNamespace(http=http), handle, after_read)

    assert asyncio.run(run(after_read=False))
    assert received == [b'{"lease_id":"lease-1"}'] * 2
    received.clear()
    assert asyncio.run(run(after_read=True))  # the pull's own, whose repeated ask is answered alike
    assert received == [b'{"lease_id":"lease-1","after_read":true}'] * 2


def test_a_decode_stream_closed_before_it_began_releases_its_lease_once():
    """The decode's events hold the prefill's lease: closed before their first event (the client left while the
    answer's headers went out), nothing else would release it. Closed after they began, decode_events does."""
    from tandem.workers.internal_api import DecodeStream

    released: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        released.append((await reader.readexactly(length)).decode())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def events():
        yield {"token_ids": [1]}, True

    async def run():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient() as http:
            ctx = SimpleNamespace(http=http)
            handle = SimpleNamespace(source_url=f"http://127.0.0.1:{port}", lease_id="never-read")
            unstarted = DecodeStream(events(), ctx, handle)
            unstarted.close_unstarted()
            unstarted.close_unstarted()  # the response's on_close, then anything else closing it
            await unstarted.aclose()
            started = DecodeStream(events(), ctx, SimpleNamespace(source_url=handle.source_url, lease_id="read"))
            assert [item async for item in started] == [({"token_ids": [1]}, True)]
            await started.aclose()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if released:
                    break
            await asyncio.sleep(0.2)  # any second release would have arrived by now

    asyncio.run(run())
    assert released == ['{"lease_id":"never-read"}']
