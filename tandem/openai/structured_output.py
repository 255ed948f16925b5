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
    """ValueError when the JSON schema admits no value (admits_no_value), naming a reference that leads nowhere."""
    try:
        root = json.loads(schema_text)
    except (ValueError, RecursionError):
        return
    reason = admits_no_value(root)
    if reason is not None:
        raise ValueError(reason)


def admits_no_value(root) -> str | None:
    """Why a JSON schema admits no finite value, or None when it admits one (or this cannot tell).

    A subschema admits a value when everything it requires does: its `$ref` target, each of `allOf`, one of each
    `anyOf` / `oneOf`, its required properties, and its items when it asks for at least one. A reference that leads
    only back to itself (`{"$ref": "#/$defs/a"}` with `a` that reference, or `anyOf: [that reference]`) admits
    none, and nested in a schema that is otherwise fine (a tool's parameters), the output would break off where it
    is reached. Found in one pass over the subschemas and their requirements (a worklist), so a long chain of
    references costs its length, not its square. Keywords this does not read (`not`, `if`, patterns) are taken to
    admit values."""
    if not isinstance(root, dict):
        return None if root is not False else "the JSON schema admits no value"
    nodes: dict[int, dict] = {}
    requirements: dict[int, list[tuple[str, list]]] = {}
    pending: list = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict) and id(node) not in nodes:
            nodes[id(node)] = node
            requirements[id(node)] = _requirements(root, node)
            pending.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)
    unmet = {i: 0 for i in nodes}  # requirements of each subschema not met yet
    left: dict[tuple[int, int], int] = {}  # an "all" requirement's children not admitting yet
    parents: dict[int, list[tuple[int, int]]] = {}
    for i, reqs in requirements.items():
        for r, (kind, children) in enumerate(reqs):
            schemas = [c for c in children if isinstance(c, dict)]
            if kind == "any" and any(c is True for c in children):
                continue  # met by a literal `true`
            if kind == "all" and any(c is False for c in children):
                unmet[i] += 1  # never met
                continue
            if kind == "all" and not schemas:
                continue
            unmet[i] += 1
            left[(i, r)] = len(schemas)
            for child in schemas:
                parents.setdefault(id(child), []).append((i, r))
    admitting: set[int] = set()
    queue = [i for i, count in unmet.items() if count == 0]
    while queue:
        i = queue.pop()
        if i in admitting:
            continue
        admitting.add(i)
        for parent, r in parents.get(i, ()):
            if left.get((parent, r), 0) <= 0:
                continue  # met already
            kind = requirements[parent][r][0]
            left[(parent, r)] = 0 if kind == "any" else left[(parent, r)] - 1
            if left[(parent, r)] == 0:
                unmet[parent] -= 1
                if unmet[parent] == 0:
                    queue.append(parent)
    if id(root) in admitting:
        return None
    refs = [n["$ref"] for i, n in nodes.items() if i not in admitting and isinstance(n.get("$ref"), str)]
    return "the JSON schema admits no value" + (f": {refs[0]!r} leads only back to itself" if refs else "")


def _requirements(root, node: dict) -> list[tuple[str, list]]:
    """What a subschema needs to admit a value: ("all", children) and ("any", children) groups; a child is a
    subschema or a boolean schema (`false` admits nothing)."""
    reqs: list[tuple[str, list]] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if target is node:
            reqs.append(("all", [False]))
        elif isinstance(target, (dict, bool)):
            reqs.append(("all", [target]))
    if isinstance(node.get("allOf"), list):
        reqs.append(("all", node["allOf"]))
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            reqs.append(("any", node[key]))
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    names = node.get("required") if isinstance(node.get("required"), list) else []
    required = [properties[name] for name in names if isinstance(name, str) and name in properties]
    if required:
        reqs.append(("all", required))
    items = node.get("items")
    if isinstance(items, (dict, bool)) and isinstance(node.get("minItems"), int) and node["minItems"] > 0:
        reqs.append(("all", [items]))
    return [(kind, [c for c in children if isinstance(c, (dict, bool))]) for kind, children in reqs]


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
