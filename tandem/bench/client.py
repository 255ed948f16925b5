"""One streaming OpenAI request, timed: TTFT, the gaps between tokens, and E2E.

Timing follows what a user sees: TTFT is the time from sending the request to the first chunk that carries
text (a chat stream's opening role-only chunk does not count); each later text chunk adds one inter-token
gap; E2E ends when the stream ends. A server may put more than one token in a chunk (a detokenizer holding
back an incomplete UTF-8 sequence), so `tpot_s` = (E2E - TTFT) / (completion tokens - 1) is also kept: the
mean time per output token after the first, from the server's own token count.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import httpx

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestRecord:
    point: int
    index: int
    warmup: bool
    input_tokens: int  # asked for
    output_tokens: int  # asked for (max_tokens)
    scheduled_s: float = 0.0  # planned send time from the start of the point (rate sweeps)
    start_s: float = 0.0  # actual send time from the start of the point
    finished_s: float | None = None  # when it ended, done or failed, from the start of the point
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # as the server counted them (usage)
    completion_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def request_body(endpoint: Endpoint, model: str, prompt: list[int] | str, max_tokens: int, ignore_eos: bool) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("a chat request needs a text prompt (prompt style 'words')")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, which Tandem shares: exactly max_tokens come back
    return body


def _chunk_text(chunk: dict, endpoint: Endpoint) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_streaming(client: httpx.AsyncClient, url: str, endpoint: Endpoint, body: dict,
                         record: RequestRecord, t0: float) -> RequestRecord:
    """Send one request and fill `record` with its timings; `t0` is the point's start (perf_counter)."""
    try:
        return await _send(client, url, endpoint, body, record, t0)
    finally:
        record.finished_s = time.perf_counter() - t0


async def _send(client: httpx.AsyncClient, url: str, endpoint: Endpoint, body: dict, record: RequestRecord,
                t0: float) -> RequestRecord:
    start = time.perf_counter()
    record.start_s = start - t0
    last = None
    text_chunks = 0
    try:
        async with client.stream("POST", url + ENDPOINT_PATHS[endpoint], json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {detail}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return record
                now = time.perf_counter()
                if _chunk_text(chunk, endpoint):
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    text_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.completion_tokens = usage.get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.e2e_s = time.perf_counter() - start
    if record.ttft_s is None:
        record.error = "the stream carried no text"
        return record
    if record.completion_tokens is None:
        record.completion_tokens = text_chunks  # no usage block: one token per chunk is the best guess
    if record.completion_tokens > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
    record.ok = True
    return record
