"""Tool-call parsers: with tool_choice "auto" the model answers freely, in text or in its own call format, and a
parser (the server's --tool-call-parser, as vLLM names it) reads the calls out of the text, streamed or whole.

"hermes" reads Hermes 2 Pro's format, which Qwen2.5 and many others use too: each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a block may also hold a JSON list of such objects, as SmolLM2's tool prompt asks (`<tool_call>[{...}, ...]
</tool_call>`; its empty list says "no call"). As vLLM's hermes parser reads it: the text before the first
<tool_call> is the message's content; the blocks are its calls (a last one left open by the end of the output
too); text between and after blocks is dropped; a call's name is not checked against the request's tools; and a
block that does not parse (not JSON, no string "name", "arguments" not a JSON object) makes the text content.
vLLM then answers the whole output as content; here that holds for the first block, and a later one turns
content from where it starts, after the calls made before it: a stream cannot take back the calls it has sent,
and the whole answer says what the stream said. Arguments must be an object because this server refuses a
conversation whose calls' arguments are not (tandem.openai.tool_calls.template_tool_calls).

The parser is fed the output piece by piece and says, each time, what is decided: content up to a `<` that may
begin a tag is sent at once (a partial `<tool_` is held until the next piece tells), and each call when its
block closes, whole. Fed the whole output at once, it gives the non-streamed answer: the same by construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import orjson


@dataclass
class Parsed:
    """What one piece of output decided: content to send, and calls as (name, arguments as JSON text)."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)

    def extend(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


class HermesToolParser:
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self):
        self._pending = ""  # text not decided yet: a possible tag's beginning, or an open block
        self._in_block = False
        self._read_a_block = False  # since then, text outside blocks is dropped
        self._failed = False  # a block did not parse: from it on, everything is content

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while self._step(out):
            pass
        return out

    def end(self) -> Parsed:
        """What is left once the output is over: an open block is read as a call (vLLM's), a held `<tool_` is
        text after all."""
        out = Parsed()
        if self._in_block:
            self._in_block = False
            self._close_block(self._pending, self.START + self._pending, out)
        elif not self._read_a_block:
            out.content += self._pending
        self._pending = ""
        return out

    def _step(self, out: Parsed) -> bool:
        """Decides what `_pending` allows; False once the rest waits for more text."""
        if self._failed:
            out.content += self._pending
            self._pending = ""
            return False
        if self._in_block:
            end = self._pending.find(self.END)
            if end < 0:
                return False
            block, self._pending = self._pending[:end], self._pending[end + len(self.END):]
            self._in_block = False
            self._close_block(block, self.START + block + self.END, out)
            return True
        start = self._pending.find(self.START)
        decided = start if start >= 0 else len(self._pending) - _tag_prefix_length(self._pending, self.START)
        if not self._read_a_block:
            out.content += self._pending[:decided]
        if start < 0:
            self._pending = self._pending[decided:]
            return False
        self._pending = self._pending[start + len(self.START):]
        self._in_block = True
        return True

    def _close_block(self, block: str, written: str, out: Parsed) -> None:
        """A block's calls; or, when it does not parse, its text as `written` and all that follows as content."""
        calls = _calls_in(block)
        if calls is None:
            self._failed = True
            out.content += written
            return
        self._read_a_block = True
        out.calls += calls


def _calls_in(block: str) -> list[tuple[str, str]] | None:
    """A block's calls, None when it is not one object or a list of objects with a string name and an object of
    arguments."""
    try:
        # orjson, not json: it refuses NaN and lone surrogates, which the answer's JSON (orjson too) cannot carry.
        value = orjson.loads(block)
    except orjson.JSONDecodeError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"]
                and isinstance(item.get("arguments"), dict)):
            return None
        calls.append((item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
    return calls


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse(parser: HermesToolParser, text: str) -> Parsed:
    """The whole output read at once: what the non-streamed answer says."""
    return parser.feed(text).extend(parser.end())


ToolCallParserName = Literal["hermes"]  # the choices of --tool-call-parser (tandem.config)
TOOL_CALL_PARSERS: dict[ToolCallParserName, type[HermesToolParser]] = {"hermes": HermesToolParser}
