"""Structured outputs: the output held to a JSON schema, a regular expression, a list of choices or a grammar.

Clients ask for one with OpenAI's `response_format` (json_object, json_schema) or vLLM's `structured_outputs`
(json, regex, choice, grammar); both become a tandem.protocol.StructuredOutput in the sampling parameters. This
module turns one into the grammar text of llguidance (the guidance project's Rust engine, one of vLLM's
structured-output backends) and checks it, at the API edge of the router and of a worker alike, so that a bad
schema is a 400 before admission. A worker's engine compiles the same text into a matcher that masks, at each
step, the tokens that would leave the grammar (tandem.workers.engine.grammar).
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import llguidance

from tandem.errors import APIError
from tandem.protocol import StructuredOutput

T = TypeVar("T")

# JSON is written the way json.dumps writes it (", " and ": " between items, no other whitespace). The JSON
# grammar's default, any whitespace anywhere, lets a small model emit newlines until max_tokens runs out.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
# Compiling takes time and memory that grow with the spec (an 80,000-string choice list took 10 s): bounded.
MAX_SPEC_CHARS = 64 * 1024
# llguidance compiles recursively along a grammar's nesting: 1,000 chained $refs or 3,000 chained Lark rules (tens
# of KB) overflowed an 8 MiB thread stack and killed the process. Grammars are compiled on a thread of their own
# whose stack holds far more than a MAX_SPEC_CHARS spec can nest (it is address space; only what is used is
# memory).
_GRAMMAR_STACK_BYTES = 1 << 30


class _GrammarThread:
    """One thread with a deep stack that runs what compiles grammars, one call at a time."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(_GRAMMAR_STACK_BYTES)
            try:
                threading.Thread(target=self._run, name="grammar", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[..., T], *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)


_STACK_SIZE_LOCK = threading.Lock()
_thread: _GrammarThread | None = None
_thread_lock = threading.Lock()


def on_grammar_thread(fn: Callable[..., T], *args) -> Future:
    """fn(*args) run on the deep-stack grammar thread: what calls into llguidance's compilers must use."""
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = _GrammarThread()
    return _thread.submit(fn, *args)


async def check(spec: StructuredOutput | None, param: str | None) -> None:
    """At the API edge: a 400 naming `param` when `spec` does not compile; off the event loop."""
    if spec is None:
        return
    try:
        await asyncio.wrap_future(on_grammar_thread(grammar_text, spec))
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


@functools.lru_cache(maxsize=256)
def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec`, checked: ValueError with llguidance's reason when it is not valid. Call it
    on the grammar thread (on_grammar_thread)."""
    try:
        if spec.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.value, overrides=_JSON_LAYOUT)
        elif spec.kind == "choice":
            grammar = llguidance.grammar_from("choice", spec.value)
        else:  # "regex" and "grammar" (Lark, or GBNF converted to Lark)
            grammar = llguidance.grammar_from(spec.kind, spec.value)
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


def json_schema_spec(schema: dict | bool | str) -> StructuredOutput:
    if schema is True:  # the schema that admits any JSON value
        schema = {}
    return StructuredOutput(kind="json", value=schema if isinstance(schema, str) else json.dumps(schema))


def choice_spec(choices: list[str]) -> StructuredOutput:
    return StructuredOutput(kind="choice", value=json.dumps(choices))
