"""Function calling (tandem.openai.tool_calls): which tool_choice is served how, and how the output becomes tool calls in
the answer, streamed or not. The end to end checks with the model are in tests/workers/test_api.py and tests/router/test_router_e2e.py."""

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.errors import APIError
from tandem.openai.chat import NamedToolChoice, Tool
from tandem.openai.formatting import ChatFormatter, Delta
from tandem.openai.tool_calls import NO_PARAMETERS, ParsedToolCalls, ToolCallMode, resolve

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
    from tandem.openai.chat import ChatCompletionRequest

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
    from tandem.openai.chat import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], "tool_choice": "required"})
    assert body.structured_param == "tools"


# -- tool_choice "auto", served by the server's --tool-call-parser (tandem.openai.tool_parsers) ------------------------

OUTPUT = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
          '<tool_call>\n[{"name": "g", "arguments": {}}]\n</tool_call>')


def test_auto_is_served_by_the_servers_parser_and_refused_naming_the_option_without_one():
    from tandem.openai.chat import ChatCompletionRequest

    served = (ParsedToolCalls("hermes"), None)
    assert resolve([F], None, None, "hermes") == resolve([F], "auto", True, "hermes") == served
    assert resolve([F], "auto", False, "hermes")[0].single  # parallel_tool_calls false: one call
    assert resolve([F], "required", None, "hermes")[0] == ToolCallMode(None)  # the other choices as they were
    with pytest.raises(APIError, match="--tool-call-parser") as refused:
        resolve([F], "auto", None)
    assert refused.value.param == "tool_choice"
    # The output is free, so the request's own structured output holds it (what the end to end tests force calls
    # with); the server's parser is no field a client can set.
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        F.model_dump()], "structured_outputs": {"regex": "a+"}, "_tool_call_parser": "hermes"})
    with pytest.raises(APIError, match="--tool-call-parser"):
        body.structured_output()
    body.use_tool_call_parser("hermes")
    assert body.structured_output().value == "a+" and body.structured_param == "structured_outputs"
    assert body.tool_call_mode() == ParsedToolCalls("hermes")


def auto_formatter(parallel_tool_calls: bool | None = None) -> ChatFormatter:
    fmt = ChatFormatter("chatcmpl-1", "m", 0, None, 3)
    fmt.tool_mode, _ = resolve([F, G], "auto", parallel_tool_calls, "hermes")
    return fmt


def streamed(fmt: ChatFormatter, pieces: list[str], reason: str = "stop") -> tuple[list[dict], ChatCompletion]:
    """The chunks of a stream of `pieces`, each parsed by the OpenAI SDK, and the answer its stream helper puts
    together from them."""
    chunks = [fmt.first_chunk(), *(c for d in deltas(pieces, reason) for c in fmt.chunks(d))]
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return chunks, state.get_final_completion()


def test_auto_streams_the_content_then_each_call_as_its_block_closes():
    chunks, rebuilt = streamed(auto_formatter(), list(OUTPUT))  # a character per delta: every boundary
    content = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert "".join(filter(None, content)) == "Let me check.\n"
    assert not any("<" in piece for piece in filter(None, content))  # no tag's beginning leaks into the content
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert [[(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in call] for call in calls] == [
        [(0, "f", '{"x": 1}')], [(1, "g", "{}")]]  # two deltas: each call whole, when its block closes
    assert all(d["id"].startswith("chatcmpl-tool-") and d["type"] == "function" for call in calls for d in call)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = rebuilt.choices[0].message
    assert message.content == "Let me check.\n" and rebuilt.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("f", '{"x": 1}'), ("g", "{}")]

    whole = auto_formatter()
    for d in deltas([OUTPUT[:20], OUTPUT[20:]]):
        whole.add(d)
    answer = ChatCompletion.model_validate(whole.final()).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content == message.content
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert len({c.id for c in answer.message.tool_calls}) == 2


def test_auto_answers_without_calls_as_text_and_keeps_a_cut_answers_length():
    no_call = "Paris is sunny <tool_ or not."
    _, rebuilt = streamed(auto_formatter(), list(no_call))
    assert rebuilt.choices[0].message.content == no_call and rebuilt.choices[0].message.tool_calls is None
    assert rebuilt.choices[0].finish_reason == "stop"
    only_calls = auto_formatter()
    for d in deltas([OUTPUT.split("\n", 1)[1]], reason="length"):  # calls alone, and max_tokens ended the output
        only_calls.add(d)
    choice = only_calls.final()["choices"][0]
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 2
    assert choice["finish_reason"] == "length"
    _, single = streamed(auto_formatter(parallel_tool_calls=False), [OUTPUT])
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["f"]
