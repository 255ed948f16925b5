"""POST /tokenize and /detokenize, and GET /version, as vLLM's server has them, on workers and routers alike.

Clients use them to count a prompt's tokens against the context before sending it, to see what the chat template
makes of a conversation, and to turn token ids (from logprobs, or a prompt given as ids) back into text. Like
vLLM's, they sit outside /v1 (no API key asked) and take either a completion's `prompt` or a chat's `messages`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Body, FastAPI
from pydantic import Discriminator, Field, Tag
from pydantic.json_schema import SkipJsonSchema

import tandem
from tandem.openai.chat import ChatPrompt
from tandem.openai.params import RequestModel, refusal
from tandem.openai.protocol import check_model, check_token_ids
from tandem.protocol import TokenId
from tandem.tokenizer import Tokenizer

# Tokenizes `text` (with or without the model's special tokens); the router's may do it on a thread.
Encode = Callable[[str, bool], Awaitable[list[int]]]
# Renders a conversation by the chat template and tokenizes it; the router's renders a long one on a thread.
EncodeChat = Callable[[ChatPrompt, bool], Awaitable[list[int]]]


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the model's special tokens (a BOS), as a completion "
                                                       "of this prompt would")
    return_token_strs: bool = Field(False, description="the tokens' pieces too, as the vocabulary spells them")


class TokenizeChatRequest(ChatPrompt):
    model: str | None = None
    add_special_tokens: bool = Field(False, description="the chat template writes its own; true adds them again")
    return_token_strs: bool = False
    chat_template: SkipJsonSchema[str | None] = None  # refused, as chat completions refuse it: not what they render


# A body with `messages` is a chat's, any other a completion's: its errors are then the ones of the shape it meant.
# (The discriminator goes in Body(): FastAPI drops one annotated on the union itself. Tags named as the classes
# are, so that error_param leaves them out of the parameter an error names.)
_CHAT, _COMPLETION = TokenizeChatRequest.__name__, TokenizeCompletionRequest.__name__
_TokenizeRequest = Annotated[TokenizeChatRequest, Tag(_CHAT)] | Annotated[TokenizeCompletionRequest, Tag(_COMPLETION)]
_chat_or_completion = Discriminator(lambda body: _CHAT if isinstance(body, dict) and "messages" in body else _COMPLETION)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


def add_tokenize_routes(app: FastAPI, served_name: str, tokenizer: Tokenizer, max_model_len: Callable[[], int],
                        encode: Encode, encode_chat: EncodeChat | None = None) -> None:
    """`max_model_len` is asked per request: a router learns its workers' context length after it starts.
    Without `encode_chat`, a conversation is rendered here and tokenized by `encode`."""
    if encode_chat is None:
        async def encode_chat(body: ChatPrompt, add_special_tokens: bool) -> list[int]:
            return await encode(body.prompt_text(tokenizer), add_special_tokens)

    @app.post("/tokenize")
    async def tokenize(body: _TokenizeRequest = Body(discriminator=_chat_or_completion)):
        check_model(served_name, body.model)
        if isinstance(body, TokenizeChatRequest):
            if body.chat_template is not None:  # as chat completions refuse it
                raise refusal("chat_template")
            ids = await encode_chat(body, body.add_special_tokens)
        else:
            ids = await encode(body.prompt, body.add_special_tokens)
        pieces = [tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len(), "tokens": ids, "token_strs": pieces}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(served_name, body.model)
        check_token_ids(tokenizer.vocab_size, body.tokens, param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version():
        return {"version": tandem.__version__}
