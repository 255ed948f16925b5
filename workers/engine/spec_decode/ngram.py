"""N-gram prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens, n from max_n down to min_n."""
    length = len(token_ids)
    if k < 1 or length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        # Windows that start early enough to have at least one token after them, short of the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start:start + k]
    return []


class NgramProposer:
    """Drafts by prompt lookup over the prompt and output so far; no model."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[list[int]], max_tokens: Sequence[int]) -> list[list[int]]:
        return [ngram_lookup(tokens, self.min_n, self.max_n, k) for tokens, k in zip(token_ids, max_tokens, strict=True)]
