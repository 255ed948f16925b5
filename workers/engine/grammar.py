"""Grammar matchers for the requests with a structured output (tandem.structured_output).

Each such request holds an llguidance matcher in the state its output so far has led to. Before a step samples,
the matcher says which tokens keep the output within the grammar (a bitmask the sampler turns into -inf logits);
after, it moves on by the token sampled. A grammar is compiled once and its start state copied for each request
that asks for it: compiling a large JSON schema takes milliseconds, copying a matcher microseconds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import torch

from tandem.protocol import StructuredOutput
from tandem.structured_output import grammar_text

_CACHED_GRAMMARS = 64


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        """`tokenizer`: a tandem.tokenizer.Tokenizer (or None, and then no request may ask for a structured
        output); `vocab_size`: the width of the model's logits."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._start_states: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> start state, LRU

    def start(self, spec: StructuredOutput, output_so_far: list[int]) -> llguidance.LLMatcher:
        """A matcher for `spec`, moved past `output_so_far` (the output a continued or resumed request already
        has). ValueError if the spec is not valid, or the output so far does not follow it."""
        grammar = grammar_text(spec)
        start = self._start_states.get(grammar)
        if start is None:
            start = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            if start.is_error():
                raise ValueError(f"structured output: {start.get_error()}")
            self._start_states[grammar] = start
            if len(self._start_states) > _CACHED_GRAMMARS:
                self._start_states.popitem(last=False)
        else:
            self._start_states.move_to_end(grammar)
        matcher = start.deep_copy()
        if output_so_far and not matcher.consume_tokens(output_so_far):
            raise ValueError(f"the output so far does not follow the structured output: {matcher.get_error()}")
        return matcher

    def allowed(self, matchers: list[llguidance.LLMatcher | None], device: torch.device) -> torch.Tensor:
        """[rows, vocab] bool: the tokens each row may sample next (every token in rows without a matcher)."""
        words = (self.vocab_size + 31) // 32
        bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
        rows = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # One call for the batch: llguidance computes the rows on its own threads, without the GIL.
        self._executor.unsafe_compute_mask_ptr(rows, bits.data_ptr(), words * 4, len(matchers))
        bits = bits.to(device)
        # Bit i of word j is token 32 j + i (llguidance's layout). An arithmetic shift keeps the sign bit, and & 1
        # reads only the bit shifted down.
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        return ((bits.unsqueeze(-1) >> shifts) & 1).view(len(matchers), -1)[:, :self.vocab_size].bool()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # Built at the first request that needs it (about 0.2 s for a 49k vocabulary), from the tokenizer's own
        # definition, so the grammar sees tokens exactly as the model's tokenizer spells them.
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer, and this model was loaded without one")
            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer
