"""A response's head leaves with the first part of its body (tandem.server.response_head), driven through uvicorn's own
HTTP protocol (httptools) over a transport that records each write: the connection is the boundary faked here."""

import asyncio

import uvicorn
from starlette.responses import JSONResponse, StreamingResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from tandem.server.response_head import head_with_body

REQUEST = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"


class RecordingTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


def connect(app, request: bytes = REQUEST, wrap: bool = True) -> tuple[HttpToolsProtocol, RecordingTransport]:
    """uvicorn's protocol on a recording transport, `request` received; call in a running loop."""
    async def wrapped(scope, receive, send):
        await app(scope, receive, head_with_body(send) if wrap else send)

    config = uvicorn.Config(wrapped, http="httptools", log_level="warning", lifespan="off")
    protocol = HttpToolsProtocol(config, ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    return protocol, transport


async def answered(protocol: HttpToolsProtocol) -> None:
    for _ in range(200):  # bounded: an answer takes a few passes of the loop
        if protocol.cycle is not None and protocol.cycle.response_complete:
            break
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)  # a held head's release, if one is scheduled
    protocol.connection_lost(None)


async def serve_one(app, request: bytes = REQUEST, wrap: bool = True) -> RecordingTransport:
    """One request through uvicorn's protocol; the transport's writes once the answer is complete."""
    protocol, transport = connect(app, request, wrap)
    await answered(protocol)
    return transport


def json_app(scope, receive, send):
    return JSONResponse({"answer": 42})(scope, receive, send)


def test_a_json_answer_is_one_write_head_and_body():
    transport = asyncio.run(serve_one(json_app))
    assert len(transport.writes) == 1
    head, body = transport.writes[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 13" in head
    assert body == b'{"answer":42}'


def test_without_it_uvicorn_writes_the_head_and_the_body_apart():
    """What the wrapper changes (and what would make the test above fail without it)."""
    transport = asyncio.run(serve_one(json_app, wrap=False))
    assert len(transport.writes) == 2
    assert transport.writes[1] == b'{"answer":42}'


def test_a_stream_whose_first_event_is_not_ready_gets_its_head_at_once():
    first_event_may_go = asyncio.Event()

    async def events():
        await first_event_may_go.wait()
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def app(scope, receive, send):
        await StreamingResponse(events(), media_type="text/event-stream")(scope, receive, send)

    async def go():
        protocol, transport = connect(app)
        for _ in range(5):  # a few passes of the loop: the head must not wait for the first event
            await asyncio.sleep(0)
        writes_before_the_first_event = len(transport.writes)
        first_event_may_go.set()
        await answered(protocol)
        return writes_before_the_first_event, transport

    writes_before_the_first_event, transport = asyncio.run(go())
    assert writes_before_the_first_event == 1  # the head alone
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK") and transport.writes[0].endswith(b"\r\n\r\n")
    assert b"".join(transport.writes[1:]) == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"


def test_a_head_and_an_event_ready_in_the_same_pass_leave_together():
    async def events():
        yield b"data: role\n\n"  # chat's first chunk is ready at once
        await asyncio.sleep(0.01)
        yield b"data: token\n\n"

    async def app(scope, receive, send):
        await StreamingResponse(events(), media_type="text/event-stream")(scope, receive, send)

    transport = asyncio.run(serve_one(app))
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"\r\n\r\nc\r\ndata: role\n\n\r\n")
    assert not any(w.startswith(b"HTTP/1.1") for w in transport.writes[1:])


def test_a_connection_not_kept_alive_gets_the_whole_answer_before_it_closes():
    request = b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    transport = asyncio.run(serve_one(json_app, request))
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b'{"answer":42}')
    assert transport.closed


def test_a_head_request_gets_its_head():
    transport = asyncio.run(serve_one(json_app, b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\n"))
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"\r\n\r\n")


def test_a_send_that_is_not_uvicorns_is_left_as_it_is():
    async def send(message):
        pass

    assert head_with_body(send) is send
