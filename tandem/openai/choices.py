"""Requests for several completions at once: `n` > 1, or /v1/completions with a list of prompts.

Each choice runs as a request of its own (its own id, so its own admission, abort and resume) and the answers are
merged into one body or one stream, on the worker and on the router alike. Choices are numbered as vLLM numbers
them: prompt p's j-th sample is choice p * n + j. Usage counts each prompt once and every choice's completion.

A prompt's samples are not forked from one prefill as vLLM's parallel sampling does; instead its later samples
start once its first has its first token (`staggered`), when the prompt's KV is in that worker's prefix cache
(the router's consistent hashing sends all samples of a prompt to one worker): they compute only what the cache
lacks, and admission counts the prompt's prefill once.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tandem.errors import APIError
from tandem.openai.chat import ChatCompletionRequest
from tandem.openai.formatting import ChatFormatter, CompletionFormatter, Formatter
from tandem.openai.protocol import CompletionRequest, new_id, now
from tandem.protocol import SamplingParams
from tandem.tokenizer import Tokenizer

MAX_CHOICES = 256  # prompts x n in one request: each is a request of its own downstream


@dataclass
class Choice:
    request_id: str  # unique per choice: what admission, dispatch and aborts know it by
    prompt: int  # which of the request's prompts
    sample: int  # which of that prompt's n samples
    prompt_ids: list[int]
    params: SamplingParams
    fmt: Formatter


def sample_seed(seed: int, sample: int) -> int:
    """The seed of a prompt's `sample`-th choice: the request's own for the first (so n=1 and n>1 agree on it),
    distinct for the others (one seed for all would draw n identical samples), the same from call to call."""
    if sample == 0:
        return seed
    # A hash, not seed + k * constant: the engine seeds each position that way (Sequence.next_token_generator),
    # so a linear step would give sample j at position t the noise of sample 0 at position t + j.
    digest = hashlib.blake2b(f"{seed}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def expand(request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
           make_formatter: Callable[[int, int], Formatter]) -> list[Choice]:
    """One Choice per (prompt, sample). `make_formatter(num_prompt_tokens, index)` writes choice `index`."""
    total = len(prompts) * n
    if total > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={n} asks for {total} completions; at most {MAX_CHOICES} "
                            f"per request", param="n" if len(prompts) == 1 else "prompt")
    choices = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            sample_params = params
            if j and (params.seed is not None or params.prompt_logprobs is not None):
                # A later sample draws from a seed of its own, and takes the prompt's logprobs from its first
                # sample (request_choices) instead of computing the whole prompt again.
                sample_params = params.model_copy(update={
                    "seed": None if params.seed is None else sample_seed(params.seed, j), "prompt_logprobs": None})
            choices.append(Choice(request_id if total == 1 else f"{request_id}-{index}", p, j, ids, sample_params,
                                  make_formatter(len(ids), index)))
    return choices


def request_choices(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                    params: SamplingParams, served_name: str, tokenizer: Tokenizer) -> list[Choice]:
    """The choices of an OpenAI request (its id and creation time shared), each with the formatter its
    endpoint answers in."""
    chat = isinstance(body, ChatCompletionRequest)
    formatter = ChatFormatter if chat else CompletionFormatter
    request_id, created = new_id("chatcmpl" if chat else "cmpl"), now()
    echoes = None
    tool_mode = body.tool_call_mode() if chat else None
    if not chat and body.echo:  # each prompt as the client sent it (token ids decoded)
        echoes = [(text if isinstance(text, str) else tokenizer.decode(ids), ids)
                  for text, ids in zip(body.prompts(), prompts, strict=True)]

    def make_formatter(num_prompt_tokens: int, index: int) -> Formatter:
        fmt = formatter(request_id, served_name, created, tokenizer, num_prompt_tokens, index)
        if tool_mode is not None:
            fmt.tool_mode = tool_mode
        if echoes is not None:
            fmt.echo = echoes[index // body.n]
            fmt.echo_only = body.echo_only
        return fmt

    choices = expand(request_id, prompts, params, body.n, make_formatter)
    if echoes is not None:
        # A prompt's logprobs are computed by its first sample (expand); its later samples start once that one has
        # its first token (staggered), whose delta carries them, so they are there when a later sample needs them.
        for choice in choices:
            if choice.sample:
                choice.fmt.prompt_source = choices[choice.prompt * body.n].fmt
    return choices


@dataclass
class ChoiceDelta:
    """One choice's delta in a merged stream. `finished`: the whole answer is (this was the last choice's end)."""

    position: int  # in the list of streams merged
    delta: object
    finished: bool


class ChoicesFormatter:
    """The formatters of several choices behind one Formatter's interface (tandem.server.sse.openai_stream and the
    non-streaming paths use it unchanged); items are ChoiceDeltas."""

    def __init__(self, formatters: list[Formatter], n: int):
        self.formatters = formatters
        self.n = n  # samples per prompt: formatters[p * n] is prompt p's first
        self.request_id = formatters[0].request_id

    def add(self, item: ChoiceDelta) -> None:
        self.formatters[item.position].add(item.delta)

    def chunks(self, item: ChoiceDelta) -> list[dict]:
        return self.formatters[item.position].chunks(item.delta)

    def first_chunk(self) -> dict | None:
        firsts = [f.first_chunk() for f in self.formatters]
        if firsts[0] is None:
            return None
        return self._envelope(firsts[0]["object"], [c for first in firsts for c in first["choices"]])

    def usage(self) -> dict:
        by_prompt = [self.formatters[p:p + self.n] for p in range(0, len(self.formatters), self.n)]
        prompt_tokens = sum(group[0].num_prompt_tokens for group in by_prompt)
        completion_tokens = sum(len(f.token_ids) for f in self.formatters)
        cached = sum(group[0].num_cached_tokens for group in by_prompt)  # later samples hit the first's prefill
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self) -> dict:
        return self._envelope(self.formatters[0].chunk_object_name, [], self.usage())

    def final(self) -> dict:
        choices = [f.final()["choices"][0] for f in self.formatters]
        return self._envelope(self.formatters[0].object_name, choices, self.usage())

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        return self.formatters[0].envelope(obj, choices, usage)


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[ChoiceDelta]:
    """The items of several streams as they come, each tagged with its stream's position. The first error of
    any stream ends the merge with that error. Closing the merge (or an error) closes every stream, which is what
    aborts the choices still running."""
    loop = asyncio.get_running_loop()
    arrivals: asyncio.Queue = asyncio.Queue()
    ENDED = object()

    async def pump(position: int, stream: AsyncIterator) -> None:
        error = None
        try:
            async for item in stream:
                arrivals.put_nowait((position, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            error = exc
        finally:
            arrivals.put_nowait((position, ENDED, error))  # however it ended, or the reader would wait forever
            await stream.aclose()

    pumps = [loop.create_task(pump(i, s)) for i, s in enumerate(streams)]
    # Two counts: the merge ends when every stream has ended (`running`), but the item to flag as the answer's
    # last is the finished item that leaves no choice unfinished, which can come before the other streams' ends.
    running = unfinished = len(streams)
    try:
        while running:
            position, item, error = await arrivals.get()
            if error is not None:
                raise error
            if item is ENDED:
                running -= 1
                continue
            if item.finished:
                unfinished -= 1
            yield ChoiceDelta(position, item, bool(item.finished) and not unfinished)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def combined(choices: list[Choice], n: int, streams: list[AsyncIterator]):
    """(formatter, items) of the whole answer: a lone choice's own (no merging on the common path), else the
    choices' formatters together and their streams merged."""
    if len(choices) == 1:
        return choices[0].fmt, streams[0]
    return ChoicesFormatter([c.fmt for c in choices], n), merge(streams)


def staggered(choices: list[Choice], n: int,
              start: Callable[[Choice, asyncio.Event | None], AsyncIterator]) -> list[AsyncIterator]:
    """Each choice's stream, `start(choice, after)`. A prompt's later samples are to start once its first sample
    has its first token (or has ended), so that they find the prompt in the prefix cache instead of computing it
    alongside (module docstring): `after` is the event that says so, None for a first sample. Where to wait on
    it is the caller's: a worker before the request reaches its engine (`held_until`), the router once the
    sample's dispatch slot is taken (waiting at the head of its queue would hold every other request back)."""
    firsts: dict[int, asyncio.Event] = {}  # prompt -> set at its first sample's first token
    streams = []
    for choice in choices:
        stream = start(choice, firsts.get(choice.prompt) if choice.sample else None)
        if choice.sample == 0 and n > 1:
            firsts[choice.prompt] = asyncio.Event()
            stream = first_token_sets(stream, firsts[choice.prompt])
        streams.append(stream)
    return streams


async def first_token_sets(stream: AsyncIterator, started: asyncio.Event) -> AsyncIterator:
    """`stream` as it is, setting `started` at its first item or at its end, whichever comes first."""
    try:
        async for item in stream:
            started.set()
            yield item
    finally:
        started.set()
        await stream.aclose()


def held_until(started: asyncio.Event | None, stream: AsyncIterator) -> AsyncIterator:
    """`stream`, not started before `started` is set (`stream` itself when there is nothing to wait for)."""
    return stream if started is None else _after(started, stream)


async def _after(started: asyncio.Event, stream: AsyncIterator) -> AsyncIterator:
    await started.wait()
    try:
        async for item in stream:
            yield item
    finally:
        await stream.aclose()
