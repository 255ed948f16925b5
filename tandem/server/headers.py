"""Reading raw ASGI headers without building starlette's Headers."""

from __future__ import annotations

from collections.abc import Iterable


def header_value(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header `name` (lower case, as ASGI gives names) among raw ASGI headers."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
