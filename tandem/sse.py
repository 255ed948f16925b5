"""Server-sent events as the OpenAI API and the P/D protocol use them: `data: <json>` lines."""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def parse_sse_line(line: str) -> dict | None:
    """One `data:` line as JSON; None for [DONE], blank and non-data lines."""
    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
        return None
    return json.loads(line[6:])
