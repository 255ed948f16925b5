"""tool_choice "auto"'s parser of Hermes-format calls (tandem.openai.tool_parsers): what it reads out of an output, whole, and
that fed the same output in pieces, split anywhere, it says the same, never sending a tag's beginning as content."""

import pytest

from tandem.openai.tool_parsers import HermesToolParser, Parsed, parse

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {}}'
# Content, a call, whitespace, a second call (vLLM's layout: the JSON on a line of its own), and a SmolLM2-style
# block (a list of calls), with a `<` and a `<tool` in the content that begin no tag.
TWO_CALLS = (f"Let me look: 3 < 4 and <tools> are\n<tool_call>\n{WEATHER}\n</tool_call>\n"
             f"<tool_call>\n{TIME}\n</tool_call>")
SMOLLM2_LIST = f"<tool_call>[\n{WEATHER},\n{TIME}\n]</tool_call>"
CALLS = [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]


def whole(text: str) -> Parsed:
    return parse(HermesToolParser(), text)


def test_the_content_before_the_first_call_and_each_calls_name_and_arguments():
    assert whole(TWO_CALLS) == Parsed("Let me look: 3 < 4 and <tools> are\n", CALLS)
    assert whole(SMOLLM2_LIST) == Parsed("", CALLS)
    assert whole("No call, <tool_ or <tool_call is not a tag.") == Parsed("No call, <tool_ or <tool_call is not a tag.")
    assert whole("") == Parsed()
    # Non-ASCII arguments as the model wrote them, not \u-escaped (vLLM's ensure_ascii=False).
    assert whole('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>').calls == [
        ("f", '{"city": "Zürich"}')]


def test_text_between_and_after_calls_is_dropped_and_a_block_left_open_still_counts():
    """As vLLM's parser reads them: only the text before the first block is content; a last block the output's end
    cuts off is a call when its JSON is whole (a model that stops without its closing tag)."""
    assert whole(f"<tool_call>{TIME}</tool_call> and then <tool_call>{WEATHER}").calls == CALLS[::-1]
    assert whole(f"<tool_call>{TIME}</tool_call> That is all.").content == ""
    assert whole("<tool_call>[]</tool_call>") == Parsed()  # SmolLM2's "no call needed"


@pytest.mark.parametrize("bad", ['{"name": "f", "arguments": {"x": 1}', '{"arguments": {}}', '["f"]',
                                 '{"name": 3, "arguments": {}}', '{"name": "", "arguments": {}}',
                                 '{"name": "f", "arguments": "{}"}', '{"name": "f"}',
                                 '{"name": "f", "arguments": {"x": NaN}}'])
def test_a_block_that_does_not_parse_makes_the_text_content(bad):
    """Not JSON, no string name, arguments that are no object (which this server would refuse when the client sends
    the call back): the text is content, from the first block on the whole output, as vLLM answers it; after calls
    already made (a stream has sent them), from that block on."""
    text = f"Hm. <tool_call>\n{bad}\n</tool_call> tail"
    assert whole(text) == Parsed(text)
    assert whole(f"Hm. <tool_call>{bad}") == Parsed(f"Hm. <tool_call>{bad}")  # left open by the end
    later = f"Hm. <tool_call>{TIME}</tool_call> <tool_call>{bad}</tool_call> tail <tool_call>{WEATHER}</tool_call>"
    assert whole(later) == Parsed(f"Hm. <tool_call>{bad}</tool_call> tail <tool_call>{WEATHER}</tool_call>",
                                  [CALLS[1]])


def test_a_name_among_no_tools_is_still_a_call():
    """vLLM's hermes parser does not check names against the request's tools: the client's loop sees the call and
    can answer that there is no such tool."""
    assert whole('<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>').calls == [("launch_rocket", "{}")]


SAMPLES = [TWO_CALLS, SMOLLM2_LIST, "No call, <tool_ or <tool_call is not a tag.", "ends in a partial tag <tool_c",
           "Hm. <tool_call>{bad</tool_call> tail", f"<tool_call>{TIME}</tool_call> x <tool_call>[1]</tool_call> y",
           f"<tool_call>{WEATHER}", f"{TWO_CALLS} after"]


@pytest.mark.parametrize("text", SAMPLES)
def test_fed_in_two_pieces_split_anywhere_it_says_what_it_says_of_the_whole(text):
    expected = whole(text)
    for cut in range(len(text) + 1):
        parser = HermesToolParser()
        said = parser.feed(text[:cut]).extend(parser.feed(text[cut:])).extend(parser.end())
        assert said == expected, cut


@pytest.mark.parametrize("text", SAMPLES)
def test_fed_a_character_at_a_time_content_never_runs_ahead_of_the_whole_answers(text):
    """Content once sent cannot be taken back: at every step, what was sent is a beginning of the whole answer's
    content (so no `<tool_` that turns out a tag leaks into it), and calls come whole as their block closes."""
    expected = whole(text)
    parser, said = HermesToolParser(), Parsed()
    for i, char in enumerate(text):
        said.extend(parser.feed(char))
        assert expected.content.startswith(said.content), i
        assert said.calls == expected.calls[:len(said.calls)], i
    assert said.extend(parser.end()) == expected


def test_a_partial_tag_is_held_until_the_next_piece_tells_what_it_is():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool_") == Parsed("Hi ")
    assert parser.feed("call>\n" + TIME[:10]) == Parsed()
    assert parser.feed(TIME[10:] + "\n</tool") == Parsed()
    assert parser.feed("_call>") == Parsed("", [CALLS[1]])
    other = HermesToolParser()
    assert other.feed("a <tool_") == Parsed("a ") and other.feed("box>") == Parsed("<tool_box>")
    assert other.feed("<") == Parsed() and other.end() == Parsed("<")
