"""Several completions in one request (n > 1, batched prompts): numbering, seeds, usage and the merged stream."""

import asyncio

import pytest

from tandem.errors import APIError
from tandem.openai.choices import MAX_CHOICES, ChoicesFormatter, combined, expand, merge, sample_seed
from tandem.openai.formatting import ChatFormatter, CompletionFormatter, Delta
from tandem.protocol import INT64_MAX, INT64_MIN, SamplingParams


class _Tokenizer:
    def token_to_str(self, token_id):
        return f"<{token_id}>"


def _choices(prompts, n, params=None, cls=CompletionFormatter):
    return expand("cmpl-x", prompts, params or SamplingParams(), n,
                  lambda tokens, index: cls("cmpl-x", "m", 0, _Tokenizer(), tokens, index))


def test_choices_are_numbered_prompt_major_with_ids_of_their_own():
    choices = _choices([[1, 2, 3], [4]], n=3)
    assert [c.fmt.index for c in choices] == [0, 1, 2, 3, 4, 5]
    assert [c.prompt_ids for c in choices] == [[1, 2, 3]] * 3 + [[4]] * 3
    assert [c.request_id for c in choices] == [f"cmpl-x-{i}" for i in range(6)]
    assert _choices([[1]], n=1)[0].request_id == "cmpl-x"  # a lone choice keeps the request's id


def test_seeded_samples_differ_from_each_other_and_repeat_from_call_to_call():
    choices = _choices([[1], [2]], n=4, params=SamplingParams(seed=7, temperature=1.0))
    seeds = [c.params.seed for c in choices]
    assert seeds[0] == seeds[4] == 7  # each prompt's first sample keeps the request's seed, as n=1 would
    assert len(set(seeds[:4])) == 4 and seeds[:4] == seeds[4:]
    assert seeds == [c.params.seed for c in _choices([[1], [2]], n=4, params=SamplingParams(seed=7))]
    assert [c.params.seed for c in _choices([[1]], n=3)] == [None] * 3  # unseeded stays unseeded
    for seed in (INT64_MIN, -1, 0, INT64_MAX):
        for sample in range(5):
            assert INT64_MIN <= sample_seed(seed, sample) <= INT64_MAX
            SamplingParams(seed=sample_seed(seed, sample))  # the engine's model takes it


def test_too_many_choices_are_refused_naming_the_cause():
    for prompts, n, param in (([[1]] * 3, MAX_CHOICES // 2, "prompt"), ([[1]], MAX_CHOICES + 1, "n")):
        with pytest.raises(APIError) as info:
            _choices(prompts, n)
        assert info.value.status == 400 and info.value.param == param


def _delta(tokens, text, finished=False):
    return Delta(tokens, text, None, finished, "length" if finished else None)


def test_the_merged_body_has_every_choice_and_usage_counts_each_prompt_once():
    choices = _choices([[1, 2, 3], [4]], n=2)
    fmt = ChoicesFormatter([c.fmt for c in choices], 2)
    for position, (tokens, text) in enumerate([([5], "a"), ([6, 7], "bc"), ([8], "d"), ([9], "e")]):
        fmt.formatters[position].add(_delta(tokens, text, finished=True))
    body = fmt.final()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "bc"), (2, "d"), (3, "e")]
    assert body["usage"]["prompt_tokens"] == 3 + 1 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 9


def test_a_chat_stream_opens_every_choice_in_its_first_chunk():
    fmt = ChoicesFormatter([c.fmt for c in _choices([[1]], n=3, cls=ChatFormatter)], 3)
    first = fmt.first_chunk()
    assert [(c["index"], c["delta"]["role"]) for c in first["choices"]] == [(0, "assistant"), (1, "assistant"),
                                                                          (2, "assistant")]


async def _stream(items, delay=0.0, closed=None, then_hang=False):
    try:
        for item in items:
            await asyncio.sleep(delay)
            yield item
        if then_hang:  # a choice still generating: only a close ends it
            await asyncio.Event().wait()
    finally:
        if closed is not None:
            closed.append(True)


def test_merge_interleaves_tags_and_marks_only_the_very_last_item_finished():
    async def run():
        a = _stream([_delta([1], "a"), _delta([2], "b", True)], delay=0.01)
        b = _stream([_delta([3], "c", True)])
        return [(i.position, i.delta.new_text, i.finished) async for i in merge([a, b])]

    items = asyncio.run(run())
    assert sorted(items) == [(0, "a", False), (0, "b", True), (1, "c", False)]
    assert items[-1] == (0, "b", True)


def test_an_error_in_one_choice_ends_the_merge_and_closes_the_others():
    closed = []

    async def failing():
        yield _delta([1], "a")
        raise APIError(503, "the worker went away")

    async def run():
        slow = _stream([_delta([2], "b")], delay=0.01, closed=closed, then_hang=True)
        with pytest.raises(APIError):
            async for _ in merge([failing(), slow]):
                pass
        return list(closed)  # before asyncio.run's own clean-up could close it

    assert asyncio.run(asyncio.wait_for(run(), 10)) == [True]


def test_closing_the_merge_closes_every_stream():
    closed = []

    async def run():
        merged = merge([_stream([_delta([1], "a")], 0.01, closed, then_hang=True) for _ in range(3)])
        await merged.__anext__()
        await merged.aclose()
        return list(closed)

    assert asyncio.run(asyncio.wait_for(run(), 10)) == [True] * 3


def test_a_lone_choice_is_not_merged():
    choices = _choices([[1]], n=1)
    stream = _stream([])
    assert combined(choices, 1, [stream]) == (choices[0].fmt, stream)
    fmt, items = combined(_choices([[1]], n=2), 2, [_stream([]), _stream([])])
    assert isinstance(fmt, ChoicesFormatter)
    asyncio.run(items.aclose())
