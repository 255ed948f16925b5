"""Prompts of a wanted token length, random so that no two requests share a cached prefix.

Two styles:
  tokens  a list of random token ids, sent as the completions prompt: the length is exact on any server that
          takes token-id prompts (Tandem, vLLM, SGLang, OpenAI's legacy completions).
  words   random common English words, each one BPE token with its leading space in the GPT-2, Llama 3,
          SmolLM and Qwen vocabularies, so N words is about N tokens; the only choice for chat, where the
          chat template adds its own tokens on top. The server's reported usage.prompt_tokens is recorded
          per request, so the real length is always known afterwards.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

PromptStyle = Literal["tokens", "words"]

WORDS = tuple(dict.fromkeys("""
the of and to in is was for on with as by at from that this are be it or an his her their they we you he she
not but have has had were been one two three all more most other some time year people way day man woman
world life hand part child eye place work week case point number group problem fact money water room mother
area story house book word city night side head name state family home school water game line end back
light car food tree door table music river road field house paper body face war law art sea fire king
""".split()))


class PromptFactory:
    def __init__(self, style: PromptStyle, rng: np.random.Generator, token_id_range: tuple[int, int] = (1000, 30000)):
        if style not in ("tokens", "words"):
            raise ValueError(f"prompt style {style!r} must be 'tokens' or 'words'")
        low, high = token_id_range
        if not 0 <= low < high:
            raise ValueError(f"token id range {low}:{high} needs 0 <= LOW < HIGH")
        self.style = style
        self.rng = rng
        self.token_id_range = (low, high)

    def make(self, n_tokens: int) -> list[int] | str:
        if n_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {n_tokens}")
        if self.style == "tokens":
            return self.rng.integers(*self.token_id_range, size=n_tokens).tolist()
        picks = self.rng.integers(0, len(WORDS), size=n_tokens)
        return " ".join(WORDS[i] for i in picks)


def parse_token_id_range(text: str) -> tuple[int, int]:
    """'LOW:HIGH' (HIGH exclusive) -> (LOW, HIGH)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = int(low), int(high)
    except ValueError:
        raise ValueError(f"token id range {text!r} must look like LOW:HIGH, e.g. 1000:30000") from None
    if not 0 <= bounds[0] < bounds[1]:
        raise ValueError(f"token id range {text!r} needs 0 <= LOW < HIGH")
    return bounds
