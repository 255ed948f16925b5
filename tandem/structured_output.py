"""Structured outputs: the output held to a JSON schema, a regular expression, a list of choices or a grammar.

Clients ask for one with OpenAI's `response_format` (json_object, json_schema) or vLLM's `structured_outputs`
(json, regex, choice, grammar); both become a tandem.protocol.StructuredOutput in the sampling parameters. This
module turns one into the grammar text of llguidance (the guidance project's Rust engine, one of vLLM's
structured-output backends) and checks it, at the API edge of the router and of a worker alike, so that a bad
schema is a 400 before admission. A worker's engine compiles the same text into a matcher that masks, at each
step, the tokens that would leave the grammar (tandem.workers.engine.grammar).
"""

from __future__ import annotations

import functools
import json

import llguidance

from tandem.protocol import StructuredOutput

# JSON is written the way json.dumps writes it (", " and ": " between items, no other whitespace). The JSON
# grammar's default, any whitespace anywhere, lets a small model emit newlines until max_tokens runs out.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'


@functools.lru_cache(maxsize=256)
def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec`, checked: ValueError with llguidance's reason when it is not valid."""
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
