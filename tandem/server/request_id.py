"""The request ID: the client's `x-request-id` (or one made for it), echoed in the response, carried from the router
to the workers, and written in every log line about the request."""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from tandem.server.headers import header_value

HEADER = "x-request-id"
HEADER_RAW = HEADER.encode()
# What a client's ID may be: printable, no spaces, at most 128 characters. Anything else is replaced (a log line
# must not carry a client's newline).
VALID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")

_current: ContextVar[str | None] = ContextVar("tandem_request_id", default=None)


def from_headers(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ID from an ASGI scope's headers when it is usable, else a new one."""
    text = header_value(headers, HEADER_RAW)
    return text if text is not None and VALID.fullmatch(text) else uuid.uuid4().hex


def current() -> str | None:
    """The ID of the request this task serves; None outside one."""
    return _current.get()


def use(request_id: str | None) -> None:
    """Makes `request_id` this task's (and the tasks it starts)."""
    if request_id is not None:
        _current.set(request_id)


class LogFilter(logging.Filter):
    """Sets `record.request_id` to " [ID]" inside a request, "" outside one (for a format's `%(request_id)s`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _current.get()
        record.request_id = f" [{request_id}]" if request_id else ""
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s:%(request_id)s %(message)s"


def configure_logging(level: str | int, log_format: str = LOG_FORMAT) -> None:
    """logging.basicConfig with the request ID in each line of the root handlers."""
    logging.basicConfig(level=level, format=log_format)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LogFilter) for f in handler.filters):
            handler.addFilter(LogFilter())
