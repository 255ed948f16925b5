"""Turns generation deltas into OpenAI response bodies and stream chunks (worker and router alike).

One formatter per request accumulates what it has seen, so the non-streaming body, every stream
chunk and the usage block all come from the same state. A delta is anything with the fields of
`Delta` (the engine's RequestOutput has them).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.openai.protocol import new_id
from tandem.openai.tool_calls import ParsedToolCalls, ToolCallMode, tool_call
from tandem.openai.tool_parsers import HermesToolParser
from tandem.tokenizer import Tokenizer


@dataclass
class Delta:
    """What one step added to a request, as the formatters read it."""

    new_token_ids: list[int]
    new_text: str
    new_logprobs: list | None  # entries with token_id, logprob, top_logprobs [(id, logprob)]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # on the first delta, when asked for: an entry per prompt token (None first)
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it, if one did


RequestOutput = Delta  # the engine's RequestOutput is read through the same fields


class Formatter:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Tokenizer, num_prompt_tokens: int,
                 index: int = 0):
        self.request_id = request_id
        self.index = index  # the choice this formatter writes (tandem.openai.choices runs several side by side)
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.pieces: list[str] = []  # joined once at the end: += on an attribute copies the whole text each time
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.wants_logprobs = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, out: RequestOutput) -> None:
        self.pieces.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self.wants_logprobs = True
            self.logprobs.extend(out.new_logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def usage(self) -> dict:
        n = len(self.token_ids)
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": n,
                "total_tokens": self.num_prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def usage_chunk(self) -> dict:
        return self.envelope(self.chunk_object_name, [], self.usage())

    def first_chunk(self) -> dict | None:
        return None

    def chunks(self, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def final(self) -> dict:
        raise NotImplementedError

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_to_str(token_id)


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"
    # echo: (the prompt's text, its token ids), which the answer repeats before its own text (and, with logprobs,
    # the prompt tokens' logprobs before its own: the first token has none, nothing predicts it).
    echo: tuple[str, list[int]] | None = None
    echo_only = False  # max_tokens 0 with echo: the one token made is not part of the answer
    prompt_logprobs: list | None = None
    prompt_source: CompletionFormatter | None = None  # a later sample's: its prompt's first sample, which has them
    echoed = False
    streamed_chars = 0  # text_offset of the next token in a stream

    def add(self, out: RequestOutput) -> None:
        if getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.echo_only:
            self.wants_logprobs = self.wants_logprobs or out.new_logprobs is not None
        super().add(self._shown(out))

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """What of `out` the answer shows: with echo_only, none of its tokens, only whether it ended."""
        if not self.echo_only:
            return out
        # Its end is max_tokens 0's: "length", whatever ended the one token made (vLLM's answer too).
        reason = "length" if out.finish_reason == "stop" else out.finish_reason
        return Delta([], "", None, out.finished, reason, out.num_cached_tokens)

    def _logprobs_block(self, entries: list, with_prompt: bool = False, offset: int = 0) -> dict | None:
        """OpenAI's legacy logprobs of `entries` (and of the echoed prompt before them). `offset`: where the first
        token's text starts in the answer's text (text_offset counts on from it, token text by token text)."""
        if not self.wants_logprobs:
            return None
        tokens, token_logprobs, top_logprobs = [], [], []
        if with_prompt and self.echo is not None:
            known = (self.prompt_source or self).prompt_logprobs or []
            for i, token_id in enumerate(self.echo[1]):
                entry = known[i] if i < len(known) else None
                tokens.append(self._token_text(token_id))
                token_logprobs.append(None if entry is None else entry.logprob)
                top_logprobs.append(None if entry is None else self._top(token_id, entry))
        tokens += [self._token_text(e.token_id) for e in entries]
        token_logprobs += [e.logprob for e in entries]
        top_logprobs += [self._top(e.token_id, e) for e in entries]
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}

    def _top(self, token_id: int, entry) -> dict[str, float]:
        """The most likely tokens and, when it is not among them, the token itself: up to logprobs + 1 entries,
        as OpenAI's completions API documents it (and vLLM answers). Keyed by text, as OpenAI's are: tokens that
        read alike (bytes of a character, each U+FFFD alone) share an entry, the likeliest one's."""
        top: dict[str, float] = {}
        for t, lp in entry.top_logprobs:  # most likely first
            top.setdefault(self._token_text(t), lp)
        top.setdefault(self._token_text(token_id), entry.logprob)
        return top

    def chunks(self, out: RequestOutput) -> list[dict]:
        self.add(out)
        out = self._shown(out)
        # Tokens with no text yet (part of a UTF-8 character) still have logprobs to send.
        if not out.new_text and not out.finished and not out.new_logprobs and (self.echo is None or self.echoed):
            return []
        echo_now = self.echo is not None and not self.echoed  # the first chunk carries the prompt
        self.echoed = True
        logprobs = self._logprobs_block(out.new_logprobs or [], with_prompt=echo_now, offset=self.streamed_chars)
        if logprobs is not None:
            self.streamed_chars += sum(map(len, logprobs["tokens"]))
        choice = {"index": self.index, "text": (self.echo[0] if echo_now else "") + out.new_text,
                  "logprobs": logprobs, "finish_reason": out.finish_reason if out.finished else None,
                  "stop_reason": out.stop_reason if out.finished else None}
        return [self.envelope(self.chunk_object_name, [choice])]

    def final(self) -> dict:
        text = (self.echo[0] if self.echo is not None else "") + self.text
        choice = {"index": self.index, "text": text, "logprobs": self._logprobs_block(self.logprobs, with_prompt=True),
                  "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        return self.envelope(self.object_name, [choice], self.usage())


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    # Set when the output is tool calls (tandem.openai.tool_calls): one named call's arguments stream as they come; the
    # calls of a "required" output are whole only at its end, so they are sent then; "auto"'s parser sends content
    # and each call as it reads them.
    tool_mode: ToolCallMode | ParsedToolCalls | None = None
    _named_call_id: str | None = None
    _calls_made = False  # a "required" output's calls are made once (_required_calls)
    _calls: list[dict] | None = None
    _parser: HermesToolParser | None = None  # "auto"'s, made when it has the output's first piece to read (_parse)
    _parsed_content: list[str]  # what "auto"'s parser has said so far: the content, and the calls with their ids
    _parsed_calls: list[dict]

    def _logprobs_block(self, entries: list) -> dict | None:
        if not self.wants_logprobs:
            return None

        def item(token_id: int, logprob: float) -> dict:
            # The token's own bytes: part of a UTF-8 character reads as U+FFFD in `token`, and `bytes` is how a
            # client puts such characters back together.
            return {"token": self._token_text(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]} for e in entries]}

    def _chunk(self, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> dict:
        return self.envelope(self.chunk_object_name, [{"index": self.index, "delta": delta, "logprobs": logprobs,
                                                       "finish_reason": finish_reason, "stop_reason": stop_reason}])

    def first_chunk(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def chunks(self, out: RequestOutput) -> list[dict]:
        self.add(out)
        chunks = []
        mode = self.tool_mode
        if isinstance(mode, ParsedToolCalls):  # "auto": what the parser has decided, content and calls
            delta = self._parse(out.new_text, out.finished)
            if delta or out.new_logprobs:
                chunks.append(self._chunk(delta, self._logprobs_block(out.new_logprobs or [])))
        elif mode is not None and mode.name is None:  # "required": the calls, once the array is whole
            if out.finished:
                calls = self._required_calls()
                delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls is not None \
                    else {"content": self.text}
                chunks.append(self._chunk(delta, self._logprobs_block(self.logprobs)))
        elif out.new_text or out.new_logprobs:  # tokens with no text yet still have logprobs to send
            delta = {"content": out.new_text}
            if mode is not None:  # one named call: its arguments as they come, its id and name with the first
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": out.new_text}}]}
                if self._named_call_id is None:
                    self._named_call_id = new_id("chatcmpl-tool")
                    delta["tool_calls"][0].update(id=self._named_call_id, type="function")
                    delta["tool_calls"][0]["function"]["name"] = mode.name
            chunks.append(self._chunk(delta, self._logprobs_block(out.new_logprobs or [])))
        if out.finished:
            chunks.append(self._chunk({}, None, self._finish_reason(), out.stop_reason))
        return chunks

    def _parse(self, text: str, finished: bool) -> dict:
        """"auto": what the parser decides with `text`, the output's next piece (and its end when `finished`),
        recorded and as a stream's delta: content, then the new calls, each whole with its id (parallel_tool_calls
        false: the first call only)."""
        if self._parser is None:
            self._parser, self._parsed_content, self._parsed_calls = self.tool_mode.new_parser(), [], []
        parsed = self._parser.feed(text)
        if finished:
            parsed.extend(self._parser.end())
        calls = [tool_call(new_id, name, arguments) for name, arguments in parsed.calls]
        if self.tool_mode.single:
            calls = [] if self._parsed_calls else calls[:1]
        delta = {"content": parsed.content} if parsed.content else {}
        if calls:
            delta["tool_calls"] = [{"index": len(self._parsed_calls) + i, **call} for i, call in enumerate(calls)]
        self._parsed_content.append(parsed.content)
        self._parsed_calls += calls
        return delta

    def _parsed_whole(self) -> None:
        """Not streamed, the parser reads the whole output at once, when the answer is made."""
        if self._parser is None:
            self._parse(self.text, True)

    def _parsed_message(self) -> dict:
        """"auto"'s message: the content before the calls (null when there is none) and the calls; with no calls,
        the content as any text answer has it."""
        self._parsed_whole()
        content = "".join(self._parsed_content)
        if not self._parsed_calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": self._parsed_calls}

    def _required_calls(self) -> list[dict] | None:
        """A "required" output's calls, made once (its ids are the same streamed or in the final body)."""
        if not self._calls_made:
            self._calls, self._calls_made = self.tool_mode.calls(self.text, new_id), True
        return self._calls

    def _finish_reason(self) -> str | None:
        """The output's own, but "tool_calls" for the calls of a "required" output, and for an "auto" output that
        made calls, as OpenAI and vLLM say it (a named call ends with "stop", as in both)."""
        mode = self.tool_mode
        if self.finish_reason != "stop" or mode is None:
            return self.finish_reason
        if isinstance(mode, ParsedToolCalls):
            self._parsed_whole()
            made_calls = bool(self._parsed_calls)
        else:
            made_calls = mode.name is None and self._required_calls() is not None
        return "tool_calls" if made_calls else self.finish_reason

    def _message(self) -> dict:
        mode = self.tool_mode
        if isinstance(mode, ParsedToolCalls):
            return self._parsed_message()
        calls = None if mode is None else self._required_calls() if mode.name is None else mode.calls(self.text, new_id)
        if calls is None:
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def final(self) -> dict:
        choice = {"index": self.index, "message": self._message(),
                  "logprobs": self._logprobs_block(self.logprobs), "finish_reason": self._finish_reason(),
                  "stop_reason": self.stop_reason}
        return self.envelope(self.object_name, [choice], self.usage())
