"""What a JSON schema's patternProperties cost to compile, the figures behind structured_output's
MAX_PATTERN_PROPERTIES.

llguidance compiles a schema (LLMatcher.validate_grammar, what tandem.openai.structured_output.grammar_text calls) on the
one grammar thread a process has: a slow one holds every other structured request back. Times, in this process:
  one object with N patternProperties (`^a{i}[a-z]*$`, disjoint), N in --counts (past the cap: llguidance itself);
  --objects objects of 2 patternProperties each (under the cap per object, many in all);
  grammar_text on one object of cap + 1: the refusal, before any compiling.
Prints conditions and figures; asserts nothing.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/schema_compile.py [--counts 16,32,64,100,160,320] [--objects 60]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import llguidance

from tandem.openai.structured_output import _JSON_LAYOUT, MAX_PATTERN_PROPERTIES, grammar_text
from tandem.protocol import StructuredOutput


def patterns(count: int, tag: str = "") -> dict:
    return {"type": "object", "patternProperties": {f"^a{tag}{i}[a-z]*$": {"type": "integer"} for i in range(count)}}


def compile_seconds(schema: dict) -> tuple[float, str]:
    """llguidance's compile of `schema`, timed; and its error, if any."""
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_LAYOUT)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return time.perf_counter() - started, error or ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="16,32,64,100,160,320", help="patternProperties in one object")
    ap.add_argument("--objects", type=int, default=60, help="objects of 2 patternProperties each")
    args = ap.parse_args()
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}; CPU: {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; llguidance {llguidance.__version__}")
    print(f"MAX_PATTERN_PROPERTIES (per object): {MAX_PATTERN_PROPERTIES}")
    print("schema                                       |  chars | compile s")
    for count in map(int, args.counts.split(",")):
        schema = patterns(count)
        seconds, error = compile_seconds(schema)
        print(f"one object, {count:4d} patternProperties          | {len(json.dumps(schema)):6d} | {seconds:9.3f}"
              + (f"  ({error[:60]})" if error else ""))
    many = {"type": "object", "properties": {f"o{j}": patterns(2, tag=f"x{j}x") for j in range(args.objects)}}
    seconds, error = compile_seconds(many)
    print(f"{args.objects:4d} objects of 2 patternProperties each    | {len(json.dumps(many)):6d} | {seconds:9.3f}"
          + (f"  ({error[:60]})" if error else ""))
    over = StructuredOutput(kind="json", value=json.dumps(patterns(MAX_PATTERN_PROPERTIES + 1, tag="r")))
    started = time.perf_counter()
    try:
        grammar_text(over)
        refused = "compiled (not refused)"
    except ValueError as exc:
        refused = f"refused: {str(exc)[:60]}"
    print(f"grammar_text, one object of {MAX_PATTERN_PROPERTIES + 1}: {time.perf_counter() - started:.4f} s, {refused}")


if __name__ == "__main__":
    main()
