"""Function calling (`tools` on chat completions), as vLLM serves it.

`tool_choice` says what the answer is:
  {"type": "function", "function": {"name": N}}   one call of N: the output is constrained to N's `parameters`
                                                 schema, and is that call's arguments;
  "required"                                      one call or more: the output is constrained to a JSON array of
                                                 {"name": ..., "parameters": ...} objects, one of the tools each
                                                 (vLLM's schema; at most one with parallel_tool_calls false);
  "none"                                          no call: the tools are only shown to the chat template;
  "auto" (the default when tools are given)       text or calls, as the model chooses: the output is free (or
                                                 held to the request's own structured output), and the server's
                                                 --tool-call-parser reads the calls out of it in the model's own
                                                 format (tandem.openai.tool_parsers). Without one it is refused, saying
                                                 what to use instead, as vLLM refuses it.

Both constrained forms go through structured outputs (tandem.openai.structured_output), so they hold on every path a
structured output does (P/D, resumed decodes). The answer's message then has `tool_calls` and no content. Its
finish_reason is "tool_calls" for the calls of a "required" output and the output's own for a named call ("stop",
or "length" when max_tokens cut it), as OpenAI and vLLM say them. A required output cut short is no JSON array: it
is answered as content, so the client sees what came. An "auto" answer has the content and the calls the parser
found, and ends with "tool_calls" when it made calls and stopped by itself (a cut one keeps "length").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.errors import APIError
from tandem.openai.structured_output import admits_no_value
from tandem.openai.tool_parsers import TOOL_CALL_PARSERS, HermesToolParser

if TYPE_CHECKING:  # the request models are tandem.openai.chat's, which imports this module
    from tandem.openai.chat import Tool, ToolCall, ToolChoice

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallMode:
    """How a constrained output becomes tool calls: `name` for one call of that function, None for "required"."""

    name: str | None

    def calls(self, text: str, new_id) -> list[dict] | None:
        """The output as OpenAI tool_calls; None when it is not a whole call list (cut by max_tokens). `new_id`
        (tandem.openai.protocol's) is passed in: that module imports this one, through tandem.openai.chat."""
        if self.name is not None:
            return [tool_call(new_id, self.name, text)]
        try:
            return [tool_call(new_id, item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                    for item in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class ParsedToolCalls:
    """tool_choice "auto": the output is free, and a parser of `parser`'s kind reads its calls out of it. `single`:
    parallel_tool_calls false, so only the first call counts."""

    parser: str
    single: bool = False

    def new_parser(self) -> HermesToolParser:
        """One per answer: a parser keeps the state of the output it has read."""
        return TOOL_CALL_PARSERS[self.parser]()


def tool_call(new_id, name: str, arguments: str) -> dict:
    """A call as the answer gives it, with an id of its own."""
    return {"id": new_id("chatcmpl-tool"), "type": "function", "function": {"name": name, "arguments": arguments}}


def resolve(tools: list[Tool] | None, choice: ToolChoice | None, parallel_tool_calls: bool | None,
            parser: str | None = None) -> tuple[ToolCallMode | ParsedToolCalls | None, dict | None]:
    """(how the output becomes calls, the JSON schema that constrains it), both None for an answer in text; the
    schema is None too for "auto", which `parser` (the server's --tool-call-parser) serves: a 400 for a choice that
    cannot be served."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct names", param="tools")
    if choice is None or choice == "auto":
        if parser is None:
            raise APIError(400, 'tool_choice "auto" (the default with tools) lets the model answer in text or in '
                                "calls, which needs a parser for this model's call format, and this server has "
                                "none: start it with --tool-call-parser (hermes reads <tool_call> blocks), or set "
                                'tool_choice to "required", to "none", or to {"type": "function", "function": '
                                '{"name": ...}}', param="tool_choice")
        return ParsedToolCalls(parser, single=parallel_tool_calls is False), None
    if choice == "none":
        return None, None
    for tool in tools:  # each tool the output may call must admit arguments (one that admits none breaks it off)
        reason = admits_no_value(tool.function.parameters) if tool.function.parameters else None
        if reason is not None:
            raise APIError(400, f"tool {tool.function.name!r}: its parameters: {reason}", param="tools")
    if choice == "required":
        definitions: dict = {}
        items = {"type": "object", "anyOf": [_named_call_schema(tool, definitions) for tool in tools]}
        schema = {"type": "array", "minItems": 1, "items": items}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        if definitions:
            schema["$defs"] = definitions
        return ToolCallMode(None), schema
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools: {names}",
                       param="tool_choice")
    return ToolCallMode(tool.function.name), tool.function.parameters or NO_PARAMETERS


def _named_call_schema(tool: Tool, definitions: dict) -> dict:
    """One tool's item of the "required" array. Its parameters' `$defs` go to the array schema's root (into
    `definitions`), where their `#/$defs/...` references point once the parameters are nested in the array (as
    pydantic writes nested models, and the SDK's pydantic_function_tool with them)."""
    parameters = dict(tool.function.parameters or NO_PARAMETERS)
    for name, definition in parameters.pop("$defs", {}).items():
        if definitions.setdefault(name, definition) != definition:
            raise APIError(400, f"tools define {name!r} in $defs differently; one definition per name is supported",
                           param="tools")
    return {"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"]}


def template_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """An assistant message's calls as chat templates read them (transformers' convention, vLLM's too): the
    arguments as an object (none given: an empty one). Arguments that are no JSON object are the client's error, a
    400: templates iterate them, and one that failed on a string would be a 500."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"the arguments of tool call {call.id!r} are not a JSON object: "
                                f"{call.function.arguments[:100]!r}", param="messages")
        out.append({"id": call.id, "type": call.type, "function": {"name": call.function.name,
                                                                  "arguments": arguments}})
    return out
