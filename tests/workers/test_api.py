"""The worker's OpenAI API, exercised over real HTTP against a real `tandem worker` process."""

from __future__ import annotations

import json
import random
import re
import threading

import httpx
import openai
import pytest
from api_checks import (
    ASK,
    BAD_INPUTS,
    MAX_BODY,
    TIME,
    WEATHER,
    check_auto_tool_choice,
    check_echo,
    check_logit_bias,
    check_several_completions,
    check_structured_outputs,
    metric,
    streamed_tool_calls,
    wait_for,
)

from tandem.runtimes.launcher import ServiceProcess


@pytest.fixture(scope="module")
def worker():
    proc = ServiceProcess(["worker", "--role", "both", "--model", "smollm2", "--max-body-bytes", str(MAX_BODY),
                           "--num-kv-blocks", "256", "--max-model-len", "2048", "--tool-call-parser", "hermes"],
                          name="api-worker")
    with proc:
        yield proc


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_ready_models_metrics(worker):
    assert httpx.get(worker.url + "/health").json() == {"status": "ok"}
    unknown = httpx.get(worker.url + "/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert httpx.get(worker.url + "/ready").status_code == 200
    for path in ("/health", "/ready"):  # as load balancers and uptime checks may ask
        head = httpx.head(worker.url + path)
        assert head.status_code == 200 and head.content == b"", path
    models = httpx.get(worker.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    retrieved = httpx.get(worker.url + "/v1/models/smollm2").json()
    assert {**retrieved, "created": 0} == {**models["data"][0], "created": 0}  # created: the second it was asked
    other = httpx.get(worker.url + "/v1/models/org/other")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert metric(worker, "tandem_kv_blocks_total") == 256
    load = httpx.get(worker.url + "/internal/load").json()  # what the router's probes read
    assert (load["max_model_len"], load["max_num_seqs"], load["total_blocks"]) == (2048, 64, 256)


def test_load_is_also_exported_under_vllms_names(worker, client):
    """KEDA rules, the Gateway API Inference Extension and vLLM dashboards query vllm:* series by model_name."""
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    text = httpx.get(worker.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert re.search(rf'^{name}{{model_name="smollm2"}} \S+$', text, re.M), name
    assert metric(worker, "vllm:prompt_tokens_total") == metric(worker, "tandem_prompt_tokens_total") > 0
    assert metric(worker, "vllm:generation_tokens_total") == metric(worker, "tandem_generation_tokens_total") > 0
    assert 0 <= metric(worker, "vllm:kv_cache_usage_perc") <= 1


def test_openai_sdk_completions_stream_equals_non_stream(client):
    prompt = "The three primary colors are"
    full = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
    assert full.object == "text_completion"
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in client.completions.create(model="smollm2", prompt=prompt, max_tokens=24,
                                                                   temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == full.choices[0].text
    assert len(pieces) > 1  # really streamed, not one blob


def test_openai_sdk_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def decode_events(worker, **options) -> list[dict]:
    """The data events of one greedy /internal/decode answer (colocated: the worker computes the prompt)."""
    body = {"request_id": f"coalesce-{options}", "prompt_token_ids": [504, 3575, 282, 4649, 314],
            "sampling": {"temperature": 0, "max_tokens": 8, "logprobs": 2}, **options}
    with httpx.stream("POST", worker.url + "/internal/decode", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_internal_decode_coalesces_everything_after_the_first_token(worker):
    per_token = decode_events(worker)
    coalesced = decode_events(worker, coalesce_after_first=True)
    assert len(per_token) == 8 and len(coalesced) == 2
    first, rest = coalesced
    assert first == per_token[0] and len(first["token_ids"]) == 1 and "finish_reason" not in first
    assert rest["token_ids"] == [t for e in per_token[1:] for t in e["token_ids"]]
    assert rest["text"] == "".join(e["text"] for e in per_token[1:])
    assert rest["logprobs"] == [lp for e in per_token[1:] for lp in e["logprobs"]]
    assert rest["finish_reason"] == per_token[-1]["finish_reason"] == "length"


def test_token_id_prompt_and_logprobs(client):
    out = client.completions.create(model="smollm2", prompt=[504, 3575, 282, 4649, 314], max_tokens=5,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 3 and max(top.values()) >= chosen - 1e-4  # greedy picks the top one
    assert out.choices[0].text.startswith(" Paris")
    # Each token's offset in the text, token text after token text.
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    assert "".join(lp.tokens) == out.choices[0].text

    # Sampled, the token drawn is often not among the top 1: it is then listed as well (OpenAI's "logprobs + 1").
    sampled = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=20, temperature=1.5,
                                        seed=7, logprobs=1).choices[0].logprobs
    # (>=: a token reading like a likelier one, a byte of a character as U+FFFD, shares its entry)
    assert all(top[token] >= chosen - 1e-6 and 1 <= len(top) <= 2
               for token, chosen, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs))
    assert any(len(top) == 2 for top in sampled.top_logprobs)

    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_streamed_logprobs_cover_tokens_that_have_no_text_yet(client):
    """An emoji takes several byte-level tokens, and the first ones decode to no text: their logprobs still
    stream, so a streamed answer carries one logprob per token, as the whole answer does."""
    kwargs = dict(model="smollm2", prompt="My favourite emojis: \U0001F600\U0001F389\U0001F525", max_tokens=20,
                  temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert sum(len(c.logprobs.tokens) for c in chunks if c.logprobs) == len(whole.logprobs.tokens) == 20
    assert any(not c.text and c.logprobs for c in chunks)  # the case at hand: tokens with no text yet
    assert "".join(c.text for c in chunks) == whole.text

    messages = [{"role": "user", "content": "Reply with three emojis: \U0001F600\U0001F389\U0001F525"}]
    chat_kwargs = dict(model="smollm2", messages=messages, max_tokens=20, temperature=0, logprobs=True,
                       extra_body={"ignore_eos": True})
    whole_chat = client.chat.completions.create(**chat_kwargs).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(**chat_kwargs, stream=True) if c.choices]
    assert sum(len(c.logprobs.content) for c in streamed if c.logprobs) == len(whole_chat.logprobs.content) == 20
    assert "".join(c.delta.content or "" for c in streamed) == whole_chat.message.content
    # A token holding part of a character reads as U+FFFD; its bytes are its own, and put the text back together.
    content = whole_chat.logprobs.content
    assert any(c.token == "\ufffd" for c in content)
    assert b"".join(bytes(c.bytes) for c in content) == whole_chat.message.content.encode()

    # Offsets run on across a stream's chunks as in the whole answer.
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_seeded_sampling_and_top_k_one(client):
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=16)
    a = client.completions.create(temperature=0.9, seed=1234, **kwargs).choices[0].text
    b = client.completions.create(temperature=0.9, seed=1234, **kwargs).choices[0].text
    assert a == b
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    top1 = client.completions.create(temperature=0.9, extra_body={"top_k": 1}, **kwargs).choices[0].text
    assert top1 == greedy
    # min_p 1 keeps only tokens as likely as the likeliest: the greedy answer, at any temperature.
    min_p_one = client.completions.create(temperature=1.5, seed=7, extra_body={"min_p": 1.0}, **kwargs)
    assert min_p_one.choices[0].text == greedy


def test_several_completions_in_one_request(client):
    check_several_completions(client)


def test_later_samples_reuse_the_first_ones_prefill(worker, client):
    """The later samples of a prompt start once the first has its first token: they find the prompt cached."""
    prompt = "A fresh prompt nobody has sent before: " + " ".join(f"item{i}" for i in range(40))
    hits = metric(worker, "tandem_prefix_cache_hit_tokens_total", default=0.0)
    r = client.completions.create(model="smollm2", prompt=prompt, n=3, max_tokens=4, temperature=0.8, seed=3)
    cached_blocks = (r.usage.prompt_tokens - 1) // 16  # the last prompt token is always computed
    assert cached_blocks >= 4
    assert metric(worker, "tandem_prefix_cache_hit_tokens_total") - hits >= 2 * 16 * cached_blocks
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the first sample's, as usage counts the prompt once


def test_penalties_steer_away_from_repeats(client):
    kwargs = dict(model="smollm2", prompt="Repeat after me: the cat, the cat, the cat,", max_tokens=24,
                  temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    penalized = client.completions.create(**kwargs, frequency_penalty=2.0, presence_penalty=1.0)
    repeated = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.5}})
    words = [len(set(r.choices[0].text.split())) for r in (plain, penalized, repeated)]
    assert words[1] > words[0] and words[2] > words[0], (words, [r.choices[0].text for r in (plain, penalized)])


def test_structured_outputs_hold_the_answer_to_a_schema_a_choice_or_a_regex(client):
    check_structured_outputs(client)


def test_echo_repeats_the_prompt_with_its_logprobs(client):
    check_echo(client, "The capital of France is")


def test_min_tokens_holds_the_end_back(client):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=60, temperature=0)
    short = client.chat.completions.create(**kwargs)
    assert short.choices[0].finish_reason == "stop"
    wanted = short.usage.completion_tokens + 5
    longer = client.chat.completions.create(**kwargs, extra_body={"min_tokens": wanted})
    assert longer.usage.completion_tokens >= wanted


def test_logit_bias_steers_the_choice(client):
    check_logit_bias(client)


def test_stop_string_cuts_exactly(client):
    kwargs = dict(model="smollm2", prompt="List the days of the week: Monday,", max_tokens=30, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = client.completions.create(stop=[stop, "never in this text"], **kwargs).choices[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop  # vLLM's: which of the stops ended it
    streamed = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert [c.choices[0].stop_reason for c in streamed if c.choices][-1] == stop
    assert client.completions.create(**kwargs).choices[0].stop_reason is None  # ended by its length


def _post(worker, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(worker.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


def test_bad_input_gets_openai_error_and_spares_requests_in_flight(worker, client):
    prompt = "Write a long story about a lighthouse keeper."
    reference = client.completions.create(model="smollm2", prompt=prompt, max_tokens=48, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    streamed: list[str] = []

    def stream_in_flight():
        for c in client.completions.create(model="smollm2", prompt=prompt, max_tokens=48, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
            streamed.append(c.choices[0].text if c.choices else "")

    t = threading.Thread(target=stream_in_flight)
    t.start()
    for name, path, body, status, fragment in BAD_INPUTS:
        r = _post(worker, path, body)
        assert r.status_code == status, (name, r.text)
        if status == 200:  # not bad after all: a template variable of any name (`self` was a 500)
            continue
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}, name
        assert fragment in err["message"] or fragment == err["param"], (name, err)
    t.join(120)
    assert "".join(streamed) == reference
    assert httpx.get(worker.url + "/health").status_code == 200


def test_tokenize_counts_what_a_request_is_served_with(worker, client):
    """/tokenize (vLLM's) is how a client counts a prompt against the context before sending it: its count must be
    the prompt_tokens the same prompt is billed, for a completion and for a chat alike."""
    prompt = "The quick brown fox jumps over the lazy dog."
    messages = [{"role": "user", "content": "Name three colours."}]
    as_completion = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1)
    as_chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    counted = httpx.post(worker.url + "/tokenize", json={"model": "smollm2", "prompt": prompt}).json()
    counted_chat = httpx.post(worker.url + "/tokenize", json={"model": "smollm2", "messages": messages}).json()
    assert counted["count"] == as_completion.usage.prompt_tokens and counted["max_model_len"] == 2048
    assert counted_chat["count"] == as_chat.usage.prompt_tokens
    text = httpx.post(worker.url + "/detokenize", json={"tokens": counted["tokens"]}).json()["prompt"]
    assert text.endswith(prompt)
    assert httpx.get(worker.url + "/version").json()["version"]


def test_skip_special_tokens_false_keeps_them_in_the_text(client):
    """vLLM's skip_special_tokens: false shows the end-of-turn token and what follows it (it was ignored before)."""
    ended = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help you today?"

    def answer(skip: bool) -> str:
        return client.completions.create(model="smollm2", prompt=ended, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True, "skip_special_tokens": skip}).choices[0].text

    kept, skipped = answer(False), answer(True)
    assert "<|im_end|>" in kept and "<|im_end|>" not in skipped
    assert kept.replace("<|im_end|>", "").replace("<|im_start|>", "") == skipped


def test_model_may_be_left_out_as_in_vllm(worker):
    """There is one model: a request that names none gets it (vLLM's), and the answer says which it was."""
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})):
        answer = httpx.post(worker.url + path, json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == "smollm2", answer.text


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="x", max_tokens=0)
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_disconnected_stream_frees_its_blocks(worker):
    aborted_before = metric(worker, "tandem_requests_finished_total", 'finish_reason="abort"', default=0.0)
    body = {"model": "smollm2", "prompt": "Count slowly: one, two,", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", worker.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(8)]
        assert any(line.startswith("data: ") for line in received)
        assert metric(worker, "tandem_kv_blocks_used") > 0
    # The connection is closed: the request must be aborted and every block returned.
    assert wait_for(lambda: metric(worker, "tandem_kv_blocks_used") == 0
                    and metric(worker, "tandem_num_requests_running") == 0)
    assert metric(worker, "tandem_requests_finished_total", 'finish_reason="abort"') == aborted_before + 1


def test_an_answer_begun_by_the_client_goes_on(client):
    """vLLM's continue_final_message: the last (assistant) message stays open and the model writes on in it."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    kwargs = dict(model="smollm2", messages=messages, max_tokens=3, temperature=0)
    opened = client.chat.completions.create(**kwargs, extra_body={"add_generation_prompt": False,
                                                                  "continue_final_message": True})
    new_turn = client.chat.completions.create(**kwargs)
    # The new turn adds "<|im_end|>\n<|im_start|>assistant\n" after the message; left open, none of it.
    assert opened.usage.prompt_tokens < new_turn.usage.prompt_tokens
    assert opened.choices[0].message.content.strip().startswith("Paris")


def test_a_client_that_leaves_during_a_long_prefill_stops_it_at_the_next_step():
    """A non-streamed request whose client leaves before any output: the worker noticed only at the first token,
    once the whole prompt was computed (found by a robustness helper). Now the next step's abort stops it: of a
    4,000-token prompt computed 128 tokens a step, far from all of it is computed."""
    proc = ServiceProcess(["worker", "--role", "both", "--model", "smollm2", "--num-kv-blocks", "300",
                           "--max-model-len", "4200", "--max-num-batched-tokens", "128"], name="prefill-leaver")
    with proc:
        before = metric(proc, "tandem_computed_prompt_tokens_total", default=0)
        prompt = [random.Random(5).randrange(100, 40000) for _ in range(4000)]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proc.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 1},
                       timeout=0.5)
        assert wait_for(lambda: httpx.get(proc.url + "/internal/load").json()["in_flight"] == 0, timeout=30)
        computed = metric(proc, "tandem_computed_prompt_tokens_total", default=0) - before
        assert computed < 3000, computed
        assert metric(proc, "tandem_requests_finished_total", 'finish_reason="abort"') == 1


def test_a_chunked_body_over_the_limit_is_a_413_on_every_route(worker):
    """FastAPI turned the body limit's 413 into "There was an error parsing the body" (400) on the routes whose
    body it parses itself, /tokenize among them (found by a robustness-testing helper)."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    for path in ("/tokenize", "/v1/completions"):
        r = httpx.post(worker.url + path, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.text)
        assert "limit" in r.json()["error"]["message"]


def test_tool_choice_auto_reads_the_models_own_calls_streamed_or_not(client):
    check_auto_tool_choice(client, ASK)


def test_a_named_tool_choice_answers_with_that_call_streamed_or_not(client):
    """tool_choice naming a function: its arguments follow its parameters' schema (a structured output) and the
    answer is one call of it, with no content; streamed, the arguments come as they are made."""
    kwargs = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["city"] in ("Paris", "London", "Tokyo")
    calls, finish = streamed_tool_calls(client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and finish == "stop"


def test_tool_choice_required_answers_with_calls_of_the_tools_streamed_or_not(client):
    kwargs = dict(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                  max_tokens=120, parallel_tool_calls=False)
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls  # parallel_tool_calls false: one
    assert call.function.name in ("get_weather", "get_time")
    schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    assert set(json.loads(call.function.arguments)) == set(schema["required"])
    calls, finish = streamed_tool_calls(client, **kwargs)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call.function.name, json.loads(call.function.arguments))] and finish == "tool_calls"


def test_a_conversation_with_tool_calls_and_their_results_goes_on(client):
    """An assistant's calls and the tool's answer, sent back: accepted and rendered; tool_choice none answers in
    text with the tools shown to the template."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8, temperature=0)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
