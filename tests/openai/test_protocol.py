"""Request validation and the mapping from OpenAI parameters to SamplingParams."""

import asyncio

import pytest
from pydantic import ValidationError

from tandem.errors import APIError, error_body
from tandem.openai.chat import ChatCompletionRequest
from tandem.openai.protocol import CompletionRequest, check_length, check_request
from tandem.protocol import SamplingParams

VOCAB = 1000


def test_defaults_map_to_sampling_params():
    p = CompletionRequest(model="m", prompt="hi").sampling_params(16, VOCAB)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.logprobs) == (1.0, 1.0, -1, 16, [], None)


def test_chat_max_completion_tokens_wins_and_logprobs():
    r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                              max_completion_tokens=7, logprobs=True, top_logprobs=3, stop="END")
    p = r.sampling_params(100, VOCAB)
    assert (p.max_tokens, p.logprobs, p.stop) == (7, 3, ["END"])


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize("model,base,field", [
    *((ChatCompletionRequest, CHAT, f) for f in ("n", "stream", "logprobs", "ignore_eos", "include_stop_str_in_output",
                                               "presence_penalty", "frequency_penalty", "max_tokens", "top_logprobs")),
    *((CompletionRequest, COMPLETION, f) for f in ("n", "stream", "echo", "logprobs", "max_tokens", "seed"))])
def test_an_explicit_null_asks_for_the_default(model, base, field):
    """OpenAI types optional parameters "X or null", and its SDK sends null for an argument passed as None."""
    import json

    given = model.model_validate_json(json.dumps({**base, field: None}))
    omitted = model.model_validate_json(json.dumps(base))
    if field != "max_tokens":  # completions: None there, 16 here; the same tokens either way (below)
        assert getattr(given, field) == getattr(omitted, field)
    assert given.sampling_params(16, VOCAB) == omitted.sampling_params(16, VOCAB)


def test_a_null_in_stream_options_asks_for_the_default():
    r = ChatCompletionRequest.model_validate({**CHAT, "stream": True, "stream_options": {"include_usage": None}})
    assert r.usage_in_stream is False


@pytest.mark.parametrize("model,body,param", [
    (ChatCompletionRequest, {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    (CompletionRequest, {**COMPLETION, "stream": False, "stream_options": {"include_usage": True}}, "stream_options")])
def test_options_that_need_another_are_refused_without_it(model, body, param):
    with pytest.raises(APIError) as caught:
        model.model_validate(body).sampling_params(16, VOCAB)
    assert caught.value.status == 400 and caught.value.param == param


def test_content_parts_are_joined():
    r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert r.template_messages() == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("field,value", [("max_tokens", "3"), ("temperature", "hot"), ("temperature", -1),
                                         ("top_p", 0), ("top_p", 1.01), ("stream", "yes"), ("stop", [""]),
                                         # wider than int64 overflows torch's generator inside the engine
                                         ("seed", 2**64), ("seed", -(2**63) - 1), ("n", 0), ("n", 129),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                         ("repetition_penalty", 0), ("repetition_penalty", 1e-40),
                                         ("repetition_penalty", 101), ("temperature", float("inf")),
                                         ("top_p", float("nan"))])
def test_strict_validation(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest(**{"model": "m", "prompt": "x", field: value})


@pytest.mark.parametrize("kwargs,param", [({"max_tokens": 0}, "max_tokens"),
                                          ({"suffix": "x"}, "suffix")])
def test_unsupported_or_invalid_values_raise_api_errors(kwargs, param):
    with pytest.raises(APIError) as info:
        CompletionRequest(model="m", prompt="x", **kwargs).sampling_params(16, VOCAB)
    assert info.value.status == 400 and info.value.param == param


def test_int64_seeds_are_accepted_by_both_request_and_engine_models():
    for seed in (2**63 - 1, -(2**63)):
        params = CompletionRequest(model="m", prompt="x", seed=seed).sampling_params(16, VOCAB)
        assert params.seed == seed
    with pytest.raises(ValidationError):
        SamplingParams(seed=2**63)


def test_a_prompt_or_a_batch_of_them():
    assert CompletionRequest(model="m", prompt="one").prompts() == ["one"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]  # token ids: one prompt
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    for empty in ("", [], ["a", ""], [[1], []]):
        with pytest.raises(APIError) as info:
            CompletionRequest(model="m", prompt=empty).prompts()
        assert info.value.status == 400 and info.value.param == "prompt"


def test_error_body_shape():
    body = error_body(404, "nope", param="model", code="model_not_found")
    assert body == {"error": {"message": "nope", "type": "not_found_error", "param": "model",
                              "code": "model_not_found"}}
    assert error_body(413, "big")["error"]["code"] == "request_entity_too_large"


def test_penalties_reach_the_sampling_params():
    params = CompletionRequest(model="m", prompt="x", presence_penalty=0.5, frequency_penalty=-0.25,
                               repetition_penalty=1.2).sampling_params(16, VOCAB)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.2)
    assert params.penalized and not CompletionRequest(model="m", prompt="x").sampling_params(16, VOCAB).penalized


def test_logit_bias_by_token_id_within_the_vocabulary():
    request = CompletionRequest(model="m", prompt="x", logit_bias={"5": -100, "7": 2.5})
    assert request.sampling_params(16, vocab_size=8).logit_bias == [(5, -100.0), (7, 2.5)]
    with pytest.raises(APIError) as info:
        request.sampling_params(16, vocab_size=7)
    assert info.value.status == 400 and info.value.param == "logit_bias"
    # an Arabic-Indic digit is a digit, not an id; "05" would add to "5" past the bound
    for bad in ({"x": 1}, {"-1": 1}, {"1": 100.5}, {"٣": 1}, {"05": 1}, {" 5": 1}, {"+5": 1},
                {str(i): 1.0 for i in range(301)}):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="x", logit_bias=bad)


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {**COMPLETION, "prompt": None}, "prompt"),
    (CompletionRequest, {**COMPLETION, "prompt": [[[1]]]}, "prompt"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": 3}}},
     "response_format.json_schema.name"),
    (CompletionRequest, {**COMPLETION, "max_tokens": "3"}, "max_tokens")])
def test_an_invalid_parameter_is_named_as_the_client_wrote_it(model, body, param):
    """Not `prompt.str` or `messages.0.content.list[ContentPart]`: the union member pydantic tried is left out."""
    from tandem.errors import error_param

    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    assert error_param(caught.value.errors()[0]["loc"]) == param


@pytest.mark.parametrize("field, default", [("use_beam_search", False), ("truncate_prompt_tokens", None),
                                            ("guided_json", None), ("allowed_token_ids", None), ("bad_words", []),
                                            ("spaces_between_special_tokens", True),
                                            ("spaces_between_special_tokens", None)])
def test_a_refused_vllm_parameter_left_at_its_default_is_accepted(field, default):
    CompletionRequest(model="m", prompt="x", **{field: default}).sampling_params(16, 100)


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 0), ("guided_json", {}), ("guided_choice", []),
                                          ("guided_regex", ""), ("truncate_prompt_tokens", 0),
                                          ("allowed_token_ids", [28, 30]), ("bad_words", ["Paris"]),
                                          ("return_tokens_as_token_ids", True), ("chat_template", "{{ x }}"),
                                          ("spaces_between_special_tokens", False)])
def test_a_refused_vllm_parameter_set_to_anything_else_is_refused(field, value):
    """Even a falsy value: prompt_logprobs 0 asks vLLM for the prompt's logprobs."""
    with pytest.raises(APIError) as info:
        CompletionRequest(model="m", prompt="x", **{field: value}).sampling_params(16, 100)
    assert info.value.status == 400 and info.value.param == field


def test_min_p_reaches_the_sampling_params_and_is_bounded():
    assert CompletionRequest(model="m", prompt="x", min_p=0.05).sampling_params(16, 100).min_p == 0.05
    assert CompletionRequest(model="m", prompt="x", min_p=None).sampling_params(16, 100).min_p == 0.0
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", min_p=1.5)


def test_continuous_usage_stats_null_or_false_is_accepted():
    for value in (None, False):
        CompletionRequest(model="m", prompt="x", stream=True,
                          stream_options={"continuous_usage_stats": value}).sampling_params(16, 100)


def test_refused_vllm_parameters_are_not_in_the_schema():
    """The schema lists what is served: parameters refused whenever set are not offered there."""
    for model in (CompletionRequest, ChatCompletionRequest):
        properties = model.model_json_schema()["properties"]
        assert not {"use_beam_search", "guided_choice", "prompt_logprobs", "allowed_token_ids",
                    "spaces_between_special_tokens"} & set(properties), model
        assert "min_p" in properties, model
    assert "echo" not in ChatCompletionRequest.model_json_schema()["properties"]
    assert "echo" in CompletionRequest.model_json_schema()["properties"]


@pytest.mark.parametrize("prompt_len, max_tokens, param", [(90, 20, "max_tokens"), (100, 1, "messages"),
                                                           (150, 1, "messages")])
def test_past_the_context_names_what_to_change(prompt_len, max_tokens, param):
    """A prompt that leaves no room for a token by itself is what to shorten; otherwise max_tokens is."""
    with pytest.raises(APIError) as info:
        check_length(100, prompt_len, SamplingParams(max_tokens=max_tokens), "messages")
    assert info.value.code == "context_length_exceeded" and info.value.param == param


def test_past_the_context_names_max_completion_tokens_when_the_client_sent_it():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=50)
    params = body.sampling_params(16, 100)
    with pytest.raises(APIError) as info:
        asyncio.run(check_request(body, [[1] * 30], params, 64))
    assert info.value.param == "max_completion_tokens"


def test_stop_token_ids_outside_the_vocabulary_are_refused_not_ignored():
    with pytest.raises(APIError) as info:
        CompletionRequest(model="m", prompt="x", stop_token_ids=[5, 100]).sampling_params(16, 100)
    assert info.value.status == 400 and info.value.param == "stop_token_ids"
    assert CompletionRequest(model="m", prompt="x", stop_token_ids=[99]).sampling_params(16, 100).stop_token_ids == [99]


def test_skip_special_tokens_reaches_the_sampling_params():
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], skip_special_tokens=False)
    assert chat.sampling_params(16, 100).skip_special_tokens is False
    assert CompletionRequest(model="m", prompt="x", skip_special_tokens=None).sampling_params(16, 100).skip_special_tokens


def test_a_client_gone_before_its_body_arrived_is_no_server_error():
    """A client that declared a longer body than it sent and left: the worker logged a 60-line traceback for it
    (found by a robustness-testing helper). It is answered quietly, like any client error."""
    import asyncio

    from fastapi import FastAPI, Request

    from tandem.errors import add_openai_error_handlers

    app = FastAPI()
    add_openai_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"bytes": len(await request.body())}

    sent = []
    incoming = iter([{"type": "http.request", "body": b'{"prom', "more_body": True}, {"type": "http.disconnect"}])

    async def receive():
        return next(incoming)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"100")],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": "", "app": app}
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect out of the app before (uvicorn logged it)
    assert sent[0]["status"] == 499  # nginx's "client closed request", as for a client gone mid-answer
