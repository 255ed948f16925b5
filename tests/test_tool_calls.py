"""Function calling (tandem.tool_calls): which tool_choice is served how, and how the output becomes tool calls in
the answer, streamed or not. The end to end checks with the model are in test_api.py and test_router_e2e.py."""

import json

import pytest

from tandem.errors import APIError
from tandem.openai_format import ChatFormatter, Delta
from tandem.openai_protocol import NamedToolChoice, Tool
from tandem.tool_calls import NO_PARAMETERS, resolve

F = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}})
G = Tool.model_validate({"type": "function", "function": {"name": "g"}})


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_each_tool_choice_is_served_by_its_schema_or_refused():
    mode, schema = resolve([F, G], named("g"), None)
    assert mode.name == "g" and schema == NO_PARAMETERS
    mode, schema = resolve([F, G], "required", False)
    assert mode.name is None and schema["type"] == "array" and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert "maxItems" not in resolve([F, G], "required", None)[1]
    assert resolve([F], "none", None) == (None, None) and resolve(None, None, None) == (None, None)
    for tools, choice, message in (([F], None, "auto"), ([F], "auto", "auto"), ([F], named("h"), "not among"),
                                   (None, "required", "needs tools"), ([F, F], "required", "distinct")):
        with pytest.raises(APIError, match=message):
            resolve(tools, choice, None)


def formatter(choice) -> ChatFormatter:
    fmt = ChatFormatter("chatcmpl-1", "m", 0, None, 3)
    fmt.tool_mode, _ = resolve([F, G], choice, None)
    return fmt


def deltas(pieces: list[str], reason: str = "stop") -> list[Delta]:
    return [Delta([i], text, None, i == len(pieces) - 1, reason if i == len(pieces) - 1 else None)
            for i, text in enumerate(pieces)]


def test_a_named_call_streams_its_arguments_with_its_id_and_name_first():
    fmt = formatter(named("f"))
    chunks = [c for d in deltas(['{"x"', ": 1", "}"]) for c in fmt.chunks(d)]
    calls = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    first, *rest = [c[0] for c in calls if c]
    assert first["id"].startswith("chatcmpl-tool-") and first["function"] == {"name": "f", "arguments": '{"x"'}
    assert [r["function"] for r in rest] == [{"arguments": ": 1"}, {"arguments": "}"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    message = fmt.final()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_required_calls_come_whole_at_the_end_and_an_output_cut_short_comes_as_content():
    fmt = formatter("required")
    text = ['[{"name": "g", ', '"parameters": {}}, {"name": "f", "parameters": {"x": 2}}]']
    chunks = [c for d in deltas(text) for c in fmt.chunks(d)]
    assert len(chunks) == 2  # the calls, then the finish
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = chunks[0]["choices"][0]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "g", {}), (1, "f", {"x": 2})]
    assert len({c["id"] for c in calls}) == 2
    final = fmt.final()["choices"][0]
    assert [c["id"] for c in final["message"]["tool_calls"]] == [c["id"] for c in calls]  # the same calls
    assert final["finish_reason"] == "tool_calls"

    cut = formatter("required")
    chunks = [c for d in deltas(['[{"name": "g", "para'], reason="length") for c in cut.chunks(d)]
    assert chunks[0]["choices"][0]["delta"] == {"content": '[{"name": "g", "para'}
    final = cut.final()["choices"][0]
    assert final["message"] == {"role": "assistant", "content": '[{"name": "g", "para'}
    assert final["finish_reason"] == "length"


def test_required_lifts_the_tools_defs_to_the_root_where_their_references_point():
    """pydantic writes nested models as $defs + "#/$defs/..." references (the SDK's pydantic_function_tool too):
    nested in the array, a tool's references pointed nowhere and the schema did not compile."""
    address = {"type": "object", "properties": {"city": {"type": "string"}}}
    with_defs = Tool.model_validate({"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "$defs": {"Address": address}}}})
    _, schema = resolve([with_defs, F], "required", None)
    assert schema["$defs"] == {"Address": address}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert with_defs.function.parameters["$defs"] == {"Address": address}  # the request's own tool is unchanged
    other = Tool.model_validate({"type": "function", "function": {"name": "bill", "parameters": {
        "type": "object", "$defs": {"Address": {"type": "string"}}}}})
    with pytest.raises(APIError, match="differently") as refused:
        resolve([with_defs, other], "required", None)
    assert refused.value.param == "tools"


def test_a_conversations_call_arguments_must_be_a_json_object():
    from tandem.openai_protocol import ChatCompletionRequest

    def rendered_calls(arguments: str):
        body = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": arguments}}]}]})
        return body.template_messages()[1]["tool_calls"][0]["function"]["arguments"]

    assert rendered_calls('{"x": 1}') == {"x": 1} and rendered_calls("") == {}
    for bad in ("x=1", "[1, 2]", "3"):
        with pytest.raises(APIError, match="not a JSON object") as refused:
            rendered_calls(bad)
        assert refused.value.param == "messages"


def test_a_tools_schema_that_does_not_compile_is_blamed_on_the_tools():
    from tandem.openai_protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], "tool_choice": "required"})
    assert body.structured_param == "tools"
