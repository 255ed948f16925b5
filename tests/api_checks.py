"""The OpenAI API checks that the worker's tests (tests/workers/test_api.py) and the router's end-to-end tests
(tests/router/test_router_e2e.py) run alike, against a worker or a router, and the helpers they share."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tandem.tokenizer import load_tokenizer

MAX_BODY = 64 * 1024


def metric(worker, name: str, labels: str = "", default: float | None = None) -> float:
    """Sum of a metric's samples whose label set contains `labels` (e.g. 'finish_reason="abort"')."""
    text = httpx.get(worker.url + "/metrics").text
    values = [float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
              if labels in (m.group(1) or "")]
    if not values and default is not None:
        return default
    assert values, f"{name}{{{labels}}} not exported"
    return sum(values)


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def check_several_completions(client, long_prompt: str = "Once upon a time") -> None:
    """n > 1 and batched prompts (worker and router alike): choices numbered prompt-major, each the text it would
    be alone; seeded samples that differ from each other and repeat; streamed choices that each reach their end."""
    greedy = dict(model="smollm2", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["The capital of France is", long_prompt]
    alone = [client.completions.create(prompt=p, **greedy) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [a.choices[0].text for a in alone]
    assert [c.text for c in batch.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt counted once
    assert batch.usage.completion_tokens == 4 * 8

    sampled = dict(model="smollm2", prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=11,
                   extra_body={"ignore_eos": True})
    three = [c.text for c in sorted(client.completions.create(n=3, **sampled).choices, key=lambda c: c.index)]
    assert three == [c.text for c in sorted(client.completions.create(n=3, **sampled).choices,
                                            key=lambda c: c.index)]
    assert three[0] == client.completions.create(**sampled).choices[0].text  # n=1 draws the first sample
    assert len(set(three)) == 3

    chat = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me a joke."}], n=2, max_tokens=10,
                temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat)
    streamed, finished, usage = {0: "", 1: ""}, {}, None
    for chunk in client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert finished == {0: "length", 1: "length"}
    assert usage.completion_tokens == whole.usage.completion_tokens == 20


def check_logit_bias(client) -> None:
    [banana] = load_tokenizer("smollm2").encode(" banana", add_special_tokens=False)
    kwargs = dict(model="smollm2", prompt="My favourite fruit is", max_tokens=3, temperature=0)
    assert client.completions.create(**kwargs, logit_bias={str(banana): 100}).choices[0].text == " banana" * 3
    assert "banana" not in client.completions.create(**kwargs, logit_bias={str(banana): -100}).choices[0].text


def check_structured_outputs(client, preamble: str = "") -> None:
    """JSON schema (OpenAI's response_format), choice and a streamed regex (vLLM's structured_outputs).
    `preamble` goes before each prompt: through a router, a long one sends the requests down the P/D path."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": preamble + "Give me a person as JSON with name and age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"name", "age"} and isinstance(answer["name"], str) and isinstance(answer["age"], int)
    assert r.choices[0].finish_reason == "stop"
    kwargs = dict(model="smollm2", max_tokens=12, temperature=0)
    r = client.completions.create(**kwargs, prompt=preamble + "Is the sky blue? Answer:",
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    pattern = "[0-9]{3}-[0-9]{4}"
    chunks = client.completions.create(**kwargs, prompt=preamble + "Call me at", stream=True,
                                       extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, "".join(c.choices[0].text for c in chunks if c.choices))


def check_echo(client, prompt: str) -> None:
    """echo repeats the prompt before the completion, streamed (in the first chunk) or not, and with logprobs gives
    the prompt tokens' logprobs too (the first has none): what lm-eval's loglikelihood tasks read."""
    kwargs = dict(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    plain = client.completions.create(**kwargs).choices[0]
    echoed = client.completions.create(**kwargs, echo=True)
    choice, num_prompt = echoed.choices[0], echoed.usage.prompt_tokens
    assert choice.text == prompt + plain.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # The two most likely tokens, and the prompt's own token when it is not one of them.
    assert all(top[token] >= x - 1e-6 and 2 <= len(top) <= 3
               for token, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert lp.tokens[-1] == plain.logprobs.tokens[0]
    assert lp.token_logprobs[-1] == pytest.approx(plain.logprobs.token_logprobs[0], abs=1e-4)
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, echo=True, stream=True) if c.choices]
    assert chunks[0].text.startswith(prompt) and "".join(c.text for c in chunks) == choice.text
    assert chunks[0].logprobs.token_logprobs[1:num_prompt] == pytest.approx(lp.token_logprobs[1:num_prompt], abs=1e-4)
    # max_tokens 0 with echo (vLLM's): the prompt alone, scored.
    alone = client.completions.create(**{**kwargs, "max_tokens": 0}, echo=True)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert alone.choices[0].finish_reason == "length"
    # Its end is "length" even when the one token the engine made (which the answer leaves out) hit a stop.
    stopped = client.completions.create(**{**kwargs, "max_tokens": 0}, echo=True, stop=[plain.text])
    assert stopped.choices[0].text == prompt and stopped.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:num_prompt], abs=1e-4)
    # Several samples: the prompt's logprobs, computed by the first, in every one.
    for sample in client.completions.create(**kwargs, echo=True, n=2).choices:
        assert sample.text.startswith(prompt)
        assert sample.logprobs.token_logprobs[:num_prompt] == pytest.approx(lp.token_logprobs[:num_prompt], abs=1e-4)


BAD_INPUTS = [
    # (name, path, raw body, status, param or message fragment)
    ("malformed json", "/v1/completions", b'{"model": "smollm2", "prompt": ', 400, "not valid JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("prompt wrong type", "/v1/completions", {"model": "smollm2", "prompt": 12}, 400, "prompt"),
    ("prompt of mixed shapes", "/v1/completions", {"model": "smollm2", "prompt": ["a", [1, 2]]}, 400,
     "a list of lists of token ids"),
    ("prompt null", "/v1/completions", {"model": "smollm2", "prompt": None}, 400, "a list of token ids"),
    ("max_tokens wrong type", "/v1/completions", {"model": "smollm2", "prompt": "x", "max_tokens": "5"}, 400,
     "max_tokens"),
    ("missing prompt", "/v1/completions", {"model": "smollm2"}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "smollm2"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": "smollm2", "messages": []}, 400, "messages"),
    ("user message without content", "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user"}]},
     400, "needs content"),
    ("null content", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": None}]}, 400, "needs content"),
    ("max_tokens zero", "/v1/completions", {"model": "smollm2", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
    ("over context length", "/v1/completions", {"model": "smollm2", "prompt": "x", "max_tokens": 5000}, 400,
     "maximum context length"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("temperature negative", "/v1/completions", {"model": "smollm2", "prompt": "x", "temperature": -0.5}, 400,
     "temperature"),
    ("top_p zero", "/v1/completions", {"model": "smollm2", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {"model": "smollm2", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {"model": "smollm2", "prompt": "x", "n": 0}, 400, "n:"),
    ("n past OpenAI's bound", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "n": 129}, 400, "n:"),
    ("too many completions", "/v1/completions", {"model": "smollm2", "prompt": ["x"] * 3, "n": 100}, 400,
     "at most 256"),
    ("empty prompt in a batch", "/v1/completions", {"model": "smollm2", "prompt": ["x", ""]}, 400, "empty"),
    ("token id out of vocab", "/v1/completions", {"model": "smollm2", "prompt": [1, 99999999]}, 400, "vocabulary"),
    ("body too large", "/v1/completions", {"model": "smollm2", "prompt": "x" * (MAX_BODY + 10)}, 413, "limit"),
    # Integers past 64 bits would not even serialize on the way from a router to its workers.
    ("stop token id past 64 bits", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "stop_token_ids": [2**70]}, 400, "stop_token_ids.0"),
    ("top_k past 64 bits", "/v1/completions", {"model": "smollm2", "prompt": "x", "top_k": 2**70}, 400, "top_k"),
    # A lone UTF-16 surrogate is valid JSON escaping but no text a tokenizer takes.
    ("lone surrogate", "/v1/completions", b'{"model": "smollm2", "prompt": "hi \\ud800 there"}', 400,
     "not valid JSON"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi \\udc00"}]}', 400, "not valid JSON"),
    # OpenAI parameters a client relies on but this server does not implement: refused, not ignored.
    ("logit_bias outside the vocabulary", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "logit_bias": {"50256": -100}}, 400, "logit_bias"),
    ("logit_bias not by token id", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ("logit_bias past 100", "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                                     "logit_bias": {"42": 101}}, 400, "logit_bias"),
    ("json schema not valid", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format"),
    ("response_format unknown", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     400, "response_format"),
    ("regex not valid", "/v1/completions", {"model": "smollm2", "prompt": "x", "structured_outputs": {"regex": "[0-9"}},
     400, "structured_outputs"),
    ("two structured outputs", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("tool_choice names no tool", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
         "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool_choice without tools", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("tool calls and a response_format", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
         "name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("tool name not valid", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "no spaces"}}], "tool_choice": "required"}, 400, "tools"),
    ("functions", "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                           "functions": [{"name": "f"}]}, 400, "functions"),
    ("min_tokens past max_tokens", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("best_of", "/v1/completions", {"model": "smollm2", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("suffix", "/v1/completions", {"model": "smollm2", "prompt": "x", "suffix": "end"}, 400, "suffix"),
    # vLLM's parameters that are not implemented: refused, not ignored.
    ("use_beam_search", "/v1/completions", {"model": "smollm2", "prompt": "x", "use_beam_search": True}, 400,
     "use_beam_search"),
    ("allowed_token_ids", "/v1/completions", {"model": "smollm2", "prompt": "x", "allowed_token_ids": [28]}, 400,
     "allowed_token_ids"),
    ("stop_token_ids outside the vocabulary", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("min_p out of range", "/v1/completions", {"model": "smollm2", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("truncate_prompt_tokens", "/v1/completions", {"model": "smollm2", "prompt": "x", "truncate_prompt_tokens": 2},
     400, "truncate_prompt_tokens"),
    ("prompt_logprobs", "/v1/completions", {"model": "smollm2", "prompt": "x", "prompt_logprobs": 2}, 400, "echo"),
    ("guided_choice", "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                               "guided_choice": ["yes", "no"]}, 400, "structured_outputs"),
    ("continuous_usage_stats", "/v1/completions",
     {"model": "smollm2", "prompt": "x", "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 400, "continuous_usage_stats"),
    ("echo on chat", "/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                             "echo": True}, 400, "echo"),
    ("max_completion_tokens zero", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    # The routes outside /v1 keep the same contract (they answered FastAPI's 422 {"detail": ...} before).
    ("detokenize tokens wrong type", "/detokenize", {"tokens": "x"}, 400, "tokens"),
    ("tokenize without a prompt", "/tokenize", {"model": "smollm2"}, 400, "prompt"),
    ("chat_template_kwargs self", "/v1/chat/completions", {"model": "smollm2", "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "x"}],
                                                           "chat_template_kwargs": {"self": 1}}, 200, ""),
]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}}, "required": ["city"],
    "additionalProperties": False}}}


ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def streamed_tool_calls(client, **kwargs) -> tuple[list[dict], str]:
    """The tool calls a streamed answer made, put together from their deltas as the SDKs do, and its finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] = delta.function.name or call["name"]
                    call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


# tool_choice "auto" leaves the output to the model, which SmolLM2 135M does not fill with calls by itself (the chat
# template packaged with it does not even show it the tools): a regex (vLLM's structured outputs, which "auto" leaves
# to the request) holds its output to a sentence, a Hermes call block, and a block of SmolLM2's own list format,
# with the words and the arguments its choice. The server's parser (--tool-call-parser hermes) reads that output.
AUTO_OUTPUT = (r'[A-Z][a-z]+\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|London)", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>\n<tool_call>\[\{"name": "get_time", '
               r'"arguments": \{"city": "(Paris|London)"\}\}\]</tool_call>')


def check_auto_tool_choice(client, messages: list[dict]) -> None:
    """Not streamed: the sentence is the content and the blocks are two calls. Streamed: the same, rebuilt by the
    SDK's own stream helper from chunks where the content never holds a tag's beginning and each call comes whole,
    in a chunk of its own as its block closes."""
    kwargs = dict(model="smollm2", messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=100,
                  extra_body={"structured_outputs": {"regex": AUTO_OUTPUT}})
    answer = client.chat.completions.create(**kwargs).choices[0]  # no tool_choice: "auto", the default with tools
    assert answer.finish_reason == "tool_calls", answer
    assert re.fullmatch(r"[A-Z][a-z]+\.\n", answer.message.content)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather", "get_time"] and set(calls[0][1]) == {"city", "unit"}
    assert len({c.id for c in answer.message.tool_calls}) == 2
    state, call_chunks = ChatCompletionStreamState(), 0
    for chunk in client.chat.completions.create(stream=True, tool_choice="auto", **kwargs):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            assert "<" not in (choice.delta.content or ""), chunk
            call_chunks += bool(choice.delta.tool_calls)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == answer.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == calls
    assert call_chunks == 2
