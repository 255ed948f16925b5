"""A response's head and the first part of its body in one write to the client.

uvicorn writes an ASGI response's status line and headers as soon as `http.response.start` is sent, and its body
with the next message: two writes, so two TCP segments (TCP_NODELAY) and, on a client waiting for its answer, two
wake-ups where one would do (tests/server/test_response_head.py counts the writes).

`head_with_body(send)` holds the head until the first body message has been sent, and writes both at once; when no
body message follows in the same pass of the event loop (a stream whose first event is still being computed), the
head leaves alone at the start of the next pass, so a client is never kept waiting for it. It reaches the
connection through uvicorn's request cycle (the object `send` is bound to), which is not public API: where `send`
is not such a method, it is returned unchanged, and responses go out as before.
"""

from __future__ import annotations

import asyncio


def head_with_body(send):
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not callable(getattr(transport, "write", None)):
        return send

    async def send_joined(message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            held = cycle.transport = HeldWrites(transport)
            asyncio.get_running_loop().call_soon(held.release, cycle)  # if no body comes in this pass
            await send(message)
            return
        await send(message)
        held = cycle.transport
        if kind == "http.response.body" and isinstance(held, HeldWrites):
            held.release(cycle)

    return send_joined


class HeldWrites:
    """Stands in for a connection's transport while a response head is held: writes are kept and leave together
    at release(); from then on the cycle writes to the transport itself. Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._held: list[bytes] = []
        self._released = False

    def write(self, data: bytes) -> None:
        if self._released:  # a write after release, through a reference taken before it
            self._transport.write(data)
        else:
            self._held.append(data)

    def release(self, cycle) -> None:
        if not self._released:
            if cycle.transport is self:
                cycle.transport = self._transport
            self._flush()

    def close(self) -> None:  # uvicorn closes a connection that is not kept alive after the answer's end
        self._flush()
        self._transport.close()

    def _flush(self) -> None:
        self._released = True
        held, self._held = self._held, []
        if held and not self._transport.is_closing():  # a client gone meanwhile takes nothing
            self._transport.write(b"".join(held))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
