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
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from tandem.errors import APIError
from tandem.protocol import StructuredOutput

# JSON is written the way json.dumps writes it (", " and ": " between items, no other whitespace). The JSON
# grammar's default, any whitespace anywhere, lets a small model emit newlines until max_tokens runs out.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
# Compiling takes time and memory that grow with the spec: bounded.
MAX_SPEC_CHARS = 64 * 1024
# And faster than the spec for one feature: llguidance compiles an object's patternProperties into a regular
# expression of the keys none of them matches, at a cost that grows twenty- to thirtyfold per doubling of their
# count past 160 (benchmarks/schema_compile.py, AMD EPYC, two runs: 64 in one object 0.009 s, 100 0.027 s, 160
# 0.28-0.30 s, 320 5.9-8.2 s; 60 objects of 2 each 0.003-0.004 s), which none of llguidance's limits bounds, on the
# one thread every structured request of the process waits for. Real schemas have a handful per object.
MAX_PATTERN_PROPERTIES = 64
# Keywords whose values are JSON data, not schemas: a "patternProperties" key in them is a value's.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# llguidance compiles recursively along a grammar's nesting: the chain of 4,000 Lark rules in
# test_a_deeply_nested_grammar_compiles_without_taking_the_process_down, checked on a thread with the default 8 MiB
# stack, kills the process (SIGSEGV). Grammars are compiled on a thread of their own whose stack holds far more than a MAX_SPEC_CHARS spec can
# nest (it is address space; only what is used is memory).
_GRAMMAR_STACK_BYTES = 1 << 30
_grammar_thread: ThreadPoolExecutor | None = None
_grammar_thread_lock = threading.Lock()


def on_grammar_thread(fn: Callable, *args) -> Future:
    """fn(*args) run on the deep-stack grammar thread, one call at a time: what calls into llguidance's compilers
    must use."""
    global _grammar_thread
    with _grammar_thread_lock:
        if _grammar_thread is None:
            previous = threading.stack_size(_GRAMMAR_STACK_BYTES)
            try:
                _grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                _grammar_thread.submit(int).result()  # its one thread starts here, while the stack size holds
            finally:
                threading.stack_size(previous)
    return _grammar_thread.submit(fn, *args)


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
            _within_budget(spec.value)
            _no_reference_cycle(spec.value)
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
    if not _admits_a_first_byte(grammar):
        raise ValueError(_NOTHING_MATCHES[spec.kind])
    return grammar


_NOTHING_MATCHES = {"json": "the JSON schema admits no value", "regex": "the regular expression matches no string",
                    "choice": "no choice is given", "grammar": "the grammar matches no string"}


class _Bytes:
    """A tokenizer of one token per byte (and an end token): what a grammar admits at all, whatever the model."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _admits_a_first_byte(grammar: str) -> bool:
    """Whether an output can start at all under `grammar` (or end at once): False for a regular expression or
    schema that matches nothing, whose first step would otherwise fail with llguidance's internal state."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    return not matcher.is_error()


def _no_reference_cycle(schema_text: str) -> None:
    """ValueError naming the reference when a subschema is only a `$ref` that leads back to itself through other
    such references (`{"$ref": "#/$defs/a"}` with `a` that same reference): it admits no value, and nested in a
    schema that is otherwise fine (a tool's parameters), the output would break off where it is reached."""
    try:
        root = json.loads(schema_text)
    except (ValueError, RecursionError):
        return
    pending = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        seen: list[str] = []
        current = node
        while isinstance(current, dict) and isinstance(current.get("$ref"), str) and _only_a_reference(current):
            ref = current["$ref"]
            if ref in seen:
                raise ValueError(f"the JSON schema's reference {ref!r} refers only to itself (through "
                                 f"{' -> '.join(seen)}), so it admits no value")
            seen.append(ref)
            current = _resolve(root, ref)
        pending.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)


_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "title", "description", "$comment", "$id", "$schema",
                          "default", "examples"})


def _only_a_reference(node: dict) -> bool:
    return all(key in _ANNOTATIONS for key in node)


def _resolve(root, ref: str):
    """The subschema a local reference (`#/...`) points to; None for one that leaves the document or is broken."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _within_budget(schema_text: str) -> None:
    """ValueError when one of the schema's objects has more patternProperties than MAX_PATTERN_PROPERTIES (its
    subschemas walked without recursion: a schema may nest deeper than Python's stack)."""
    try:
        pending = [json.loads(schema_text)]
    except (ValueError, RecursionError):
        return  # not JSON, or nested past the decoder's limit: llguidance says what it makes of it
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            patterns = node.get("patternProperties")
            if isinstance(patterns, dict) and len(patterns) > MAX_PATTERN_PROPERTIES:
                raise ValueError(f"an object of the schema has {len(patterns)} patternProperties; at most "
                                 f"{MAX_PATTERN_PROPERTIES} per object are compiled")
            pending.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            pending.extend(node)


def json_schema_spec(schema: dict | bool | str) -> StructuredOutput:
    if schema is True:  # the schema that admits any JSON value
        schema = {}
    return StructuredOutput(kind="json", value=schema if isinstance(schema, str) else json.dumps(schema))


def choice_spec(choices: list[str]) -> StructuredOutput:
    return StructuredOutput(kind="choice", value=json.dumps(choices))
