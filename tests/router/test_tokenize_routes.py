"""/tokenize, /detokenize and /version (tandem.openai.tokenize_routes) on the router, over ASGI: what vLLM's clients call
to count a prompt's tokens, see a chat template's rendering and turn ids back into text."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import tandem
from tandem.config import RouterConfig
from tandem.router.app import build_app
from tandem.router.main import Router


@pytest.fixture(scope="module")
def router():
    return Router(RouterConfig(decode=["http://127.0.0.1:9"], tokenize_in_thread_chars=64))


def call(router, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(run())


@pytest.mark.parametrize("prompt", ["Hello there, how are you?", "A long prompt, tokenized on a thread. " * 8])
def test_tokenize_gives_the_ids_a_completion_of_the_prompt_is_served_with(router, prompt):
    r = call(router, "POST", "/tokenize", {"model": "smollm2", "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["tokens"] == router.tokenizer.encode(prompt) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == router.max_model_len
    assert answer["token_strs"] == [router.tokenizer.backend.id_to_token(t) for t in answer["tokens"]]
    back = call(router, "POST", "/detokenize", {"model": "smollm2", "tokens": answer["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith(prompt)


def test_tokenize_renders_a_chat_with_the_template_as_chat_completions_do(router):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    r = call(router, "POST", "/tokenize", {"messages": messages})  # model is optional, as in vLLM
    assert r.status_code == 200, r.text
    rendered = router.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.json()["tokens"] == router.tokenizer.encode(rendered, add_special_tokens=False)
    assert r.json()["token_strs"] is None
    opened = call(router, "POST", "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert opened["count"] < r.json()["count"]  # no assistant turn opened


def test_bad_tokenize_and_detokenize_requests_get_openai_errors(router):
    cases = [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": "smollm2"}, 400, "prompt"),  # neither prompt nor messages
        ("/tokenize", {"prompt": 5}, 400, "prompt"),  # the error of the shape meant, not of the other
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages.0"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
         "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400,
         "chat_template"),  # refused as chat completions refuse it: the count would not be theirs
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, None),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ]
    for path, body, status, param in cases:
        r = call(router, "POST", path, body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert error["message"] and (param is None or error["param"] == param), (path, body, error)


def test_version(router):
    assert call(router, "GET", "/version").json() == {"version": tandem.__version__}
