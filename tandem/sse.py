"""Server-sent events as the OpenAI API and the P/D protocol use them: `data: <json>` lines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.openai_format import Formatter

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def parse_sse_line(line: str) -> dict | None:
    """One `data:` line as JSON; None for [DONE], blank and non-data lines."""
    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
        return None
    return json.loads(line[6:])


async def openai_stream(
    fmt: Formatter, items: AsyncIterator, usage: bool, error_body_of: Callable[[Exception], dict | None]
) -> AsyncIterator[str]:
    """A request's OpenAI streaming body, one event flushed per item as it comes: the formatter's first chunk,
    its chunks for each item (engine outputs on a worker, deltas on the router), the usage chunk when asked,
    then [DONE]. An exception that `error_body_of` maps to a body ends the stream with that error event and
    [DONE] (the status line is long gone); any other propagates. Closing `items` at the end is what aborts
    the request upstream when the client goes away (this generator is cancelled then)."""
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield sse_event(first)
        async for item in items:
            for chunk in fmt.chunks(item):
                yield sse_event(chunk)
        if usage:
            yield sse_event(fmt.usage_chunk())
        yield DONE
    except Exception as exc:
        body = error_body_of(exc)
        if body is None:
            raise
        yield sse_event(body)
        yield DONE
    finally:
        await items.aclose()
