"""Incremental detokenization with stop strings, one instance per request.

Text is the difference between two decodes of a sliding window; text that may start a stop string is held
back, so emitted text is never taken back. Details: docs/design/engine.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens kept as left context, so the first generated token decodes as it would mid-text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # tokens[prefix:read] is text already produced (the context); tokens[read:] is not yet text.
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # decoded but not yet emitted (at most the hold-back window)
        self.stopped = False  # a stop string was found; the request must finish with "stop"
        self.matched_stop: str | None = None

    def add_token(self, token_id: int) -> str:
        """Take one generated token; return the text that can be emitted now."""
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        return self._emit(self._decode_new(final=False))

    def flush(self) -> str:
        """The request ended for a reason other than a stop string: emit everything held back."""
        if self.stopped:
            return ""
        text = self._emit(self._decode_new(final=True))
        rest, self._pending = self._pending, ""
        return text + rest

    def _decode_new(self, final: bool) -> str:
        tokens, prefix, read = self._tokens, self._prefix_offset, self._read_offset
        if read == len(tokens):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(tokens[prefix:read], skip_special_tokens=self._skip_special)
        full_text = decode(tokens[prefix:], skip_special_tokens=self._skip_special)
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # an incomplete UTF-8 character: wait for the bytes that finish it
        self._prefix_offset, self._read_offset = read, len(tokens)
        return full_text[len(prefix_text):]

    def _emit(self, delta: str) -> str:
        if not delta:
            return ""
        pending = self._pending + delta
        if not self._stops:
            return pending
        # Earlier calls searched everything before `delta`, so any match ends inside it.
        best_at, best_stop = -1, ""
        for stop in self._stops:
            at = pending.find(stop)
            if at != -1 and (best_at == -1 or at < best_at):
                best_at, best_stop = at, stop
        if best_at != -1:
            self.stopped, self.matched_stop, self._pending = True, best_stop, ""
            return pending[:best_at + len(best_stop) if self._include_stop else best_at]
        cut = len(pending) - self._hold
        if cut <= 0:
            self._pending = pending
            return ""
        self._pending = pending[cut:]
        return pending[:cut]
