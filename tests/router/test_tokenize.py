"""The router tokenizes long prompts on a thread, off its event loop, and short ones in place; the ids are the
same either way."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from tandem.config import RouterConfig
from tandem.router.app import tokenize
from tandem.tokenizer import load_tokenizer


class RecordingTokenizer:
    """The real SmolLM2 tokenizer, noting the thread each encode ran on."""

    def __init__(self):
        self.inner = load_tokenizer("smollm2")
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return self.inner.encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def recording_router():
    with ThreadPoolExecutor(1) as pool:
        yield SimpleNamespace(config=RouterConfig(tokenize_in_thread_chars=200), tokenizer=RecordingTokenizer(),
                              tokenize_pool=pool)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_long_prompts_leave_the_loop_short_ones_stay(recording_router, add_special_tokens):
    router = recording_router
    short = "The capital of France is"
    long = " ".join(f"Paragraph {i}: the river runs past the mill and the market." for i in range(20))
    assert len(short) < 200 <= len(long)

    async def both():
        loop_thread = threading.get_ident()
        router.tokenizer.threads.clear()
        ids = [await tokenize(router, text, add_special_tokens) for text in (short, long)]
        return loop_thread, ids

    loop_thread, (short_ids, long_ids) = asyncio.run(both())
    on_loop, on_thread = router.tokenizer.threads
    assert on_loop == loop_thread and on_thread != loop_thread
    assert short_ids == router.tokenizer.inner.encode(short, add_special_tokens)
    assert long_ids == router.tokenizer.inner.encode(long, add_special_tokens)
    assert len(long_ids) > 100
