"""Grammar matchers for the requests with a structured output (tandem.openai.structured_output).

Each such request holds an llguidance matcher in the state its output so far has led to. Before a step samples,
the matcher says which tokens keep the output within the grammar (a bitmask the sampler turns into -inf logits);
after, it moves on by the token sampled. A grammar is compiled once (on the grammar thread,
tandem.openai.structured_output.on_grammar_thread) and its start state copied for each request that asks for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import torch

from tandem.openai.structured_output import grammar_text, on_grammar_thread
from tandem.protocol import StructuredOutput

_CACHED_GRAMMARS = 64


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        """`tokenizer`: a tandem.tokenizer.Tokenizer (or None, and then no request may ask for a structured
        output); `vocab_size`: the width of the model's logits."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        # llguidance's vocabulary covers the tokenizer's tokens and the model's logits, whichever is the larger.
        self._mask_vocab = max(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._start_states: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()  # LRU
        # prepare() fills it from the event loop, start() reads it on the engine thread; and the compiles under way
        self._start_states_lock = threading.Lock()
        self._compiling: dict[StructuredOutput, concurrent.futures.Future] = {}

    async def prepare(self, spec: StructuredOutput) -> None:
        """Compiles `spec` on the grammar thread, for start() to find, while the caller's event loop waits: the
        engine thread, which calls start() between two steps, then does not stop every running sequence for the
        compile (seconds for some schemas). Requests that bring the same new spec at once share one compile, and
        one whose client leaves meanwhile does not cancel it: it is kept for the next. ValueError if the spec is
        not valid."""
        with self._start_states_lock:
            if spec in self._start_states:
                return
            compiling = self._compiling.get(spec)
            if compiling is None:
                compiling = self._compiling[spec] = on_grammar_thread(self._compile_and_keep, spec)
        await asyncio.shield(asyncio.wrap_future(compiling))

    def start(self, spec: StructuredOutput, output_so_far: list[int]) -> llguidance.LLMatcher:
        """A matcher for `spec`, moved past `output_so_far` (the output a continued or resumed request already
        has). ValueError if the spec is not valid, or the output so far does not follow it. Compiles `spec` here
        (on the grammar thread, waited for) only when prepare() did not, or it has left the cache since."""
        start = self._cached(spec)
        if start is None:
            start = self._keep(spec, on_grammar_thread(self._compile, spec).result())
        matcher = start.deep_copy()
        if output_so_far and not matcher.consume_tokens(output_so_far):
            raise ValueError(f"the output so far does not follow the structured output: {matcher.get_error()}")
        return matcher

    def allowed(self, matchers: list[llguidance.LLMatcher | None], device: torch.device
                ) -> tuple[list[int], torch.Tensor]:
        """(the rows with a matcher, [those rows, vocab] bool: the tokens each may sample next)."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        words = (self._mask_vocab + 31) // 32
        bits = torch.empty((len(rows), words), dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # One call for the batch: llguidance computes the rows on its own threads, without the GIL.
        self._executor.unsafe_compute_mask_ptr([(matchers[row], i) for i, row in enumerate(rows)], bits.data_ptr(),
                                               words * 4, len(rows))
        # Bit i of word j is token 32 j + i (llguidance's layout, little-endian words): byte by byte, bit by bit.
        as_bytes = bits.to(device).view(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        return rows, ((as_bytes.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :self.vocab_size].bool()

    def _cached(self, spec: StructuredOutput) -> llguidance.LLMatcher | None:
        with self._start_states_lock:
            start = self._start_states.get(spec)
            if start is not None:
                self._start_states.move_to_end(spec)
            return start

    def _keep(self, spec: StructuredOutput, start: llguidance.LLMatcher) -> llguidance.LLMatcher:
        with self._start_states_lock:
            self._start_states[spec] = start
            if len(self._start_states) > _CACHED_GRAMMARS:
                self._start_states.popitem(last=False)
        return start

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """On the grammar thread, like the llguidance tokenizer it builds the first time."""
        return _compiled(self._tokenizer(), spec)

    def _compile_and_keep(self, spec: StructuredOutput) -> None:
        """prepare()'s compile, kept from the grammar thread itself: whoever waited for it may have left."""
        try:
            self._keep(spec, self._compile(spec))
        finally:
            with self._start_states_lock:
                self._compiling.pop(spec, None)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # Built at the first request that needs it (with that request's grammar, 230-260 ms for SmolLM2's
        # vocabulary in benchmarks/structured_output.py), from the tokenizer's own definition, so the grammar sees
        # tokens exactly as the model's tokenizer spells them.
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer, and this model was loaded without one")
            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self._mask_vocab,
                                                        eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer


def _compiled(tokenizer: llguidance.LLTokenizer, spec: StructuredOutput) -> llguidance.LLMatcher:
    """A matcher in its start state (on the grammar thread). A grammar that compiles but whose very first mask
    fails (a schema that refers only to itself) is refused here rather than answered with an empty "stop"."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(f"structured output: {matcher.get_error()}")
    return matcher
