"""OpenAI API request and response models, shared by the worker server and the router: text completion requests
(chat's are tandem.openai.chat's), the checks against the served model, and the response models.
"""

from __future__ import annotations

import random
import time
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.errors import APIError
from tandem.openai.chat import ChatCompletionRequest
from tandem.openai.params import CommonParams, max_tokens_or_default
from tandem.openai.structured_output import check as check_structured
from tandem.protocol import SamplingParams

PositiveInt = Annotated[int, Field(ge=1)]


class CompletionRequest(CommonParams):
    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "smollm2", "prompt": "Once upon a time",
                                                               "max_tokens": 8}]})
    prompt_param: ClassVar[str] = "prompt"  # the parameter an error about the prompt names

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, description="tokens to generate; must be >= 1, or 0 with echo (the prompt "
                                                   "alone)")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="repeat the prompt before the completion (with logprobs: the prompt "
                                          "tokens' logprobs too)")
    best_of: int | None = None  # not implemented: refused unless 1
    suffix: str | None = None  # not implemented: refused unless empty

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_of_the_prompt_shapes(cls, value):
        # Said whole: pydantic would report the union's first member only ("Input should be a valid string"), which
        # sends someone whose list of token id lists holds one bad item the wrong way.
        def ids(item) -> bool:
            return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

        shapes = (isinstance(value, str), isinstance(value, list) and all(isinstance(p, str) for p in value),
                  ids(value), isinstance(value, list) and all(ids(p) for p in value))
        if not any(shapes):
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of lists of "
                             "token ids")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request carries: one, or a batch (a list of texts or of token id lists)."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for one in prompts:
            if len(one) == 0:
                raise APIError(400, "prompt must not be empty", param="prompt")
        return prompts

    def sampling_params(self, default_max_tokens: int, vocab_size: int) -> SamplingParams:
        """`vocab_size` bounds the token ids of logit_bias."""
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; only 1 is", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        # echo with logprobs: the prompt's logprobs as well, with as many alternatives as the output's.
        prompt_logprobs = self.logprobs if self.echo else None
        # max_tokens 0 with echo (the prompt alone, scored: vLLM's): one token is made and not shown
        # (CompletionFormatter.echo_only).
        max_tokens = 1 if self.echo_only else max_tokens_or_default(self.max_tokens, default_max_tokens)
        return self._sampling(max_tokens, self.logprobs, vocab_size, prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0


# -- checks against the served model, the same on the router and on a worker ----------------------------------


def model_not_found(served_name: str, model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist; this server serves '{served_name}'",
                    param="model", code="model_not_found")


def check_model(served_name: str, model: str | None) -> None:
    if model is not None and model != served_name:
        raise model_not_found(served_name, model)


def check_token_ids(vocab_size: int, ids: list[int], param: str = "prompt") -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)
    return ids


def check_length(max_model_len: int, prompt_len: int, params: SamplingParams, prompt_param: str = "prompt",
                 output_param: str = "max_tokens") -> None:
    """The 400 for a prompt and max_tokens past the context. Its `param` is the one to change, named as the client
    sent it: the prompt when it leaves no room for a token by itself, else the output's length."""
    total = prompt_len + params.max_tokens
    if total > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {total} tokens ({prompt_len} in the prompt, {params.max_tokens} in the "
                            "completion). Please reduce the prompt or max_tokens.",
                       param=prompt_param if prompt_len >= max_model_len else output_param,
                       code="context_length_exceeded")


def new_id(prefix: str) -> str:
    # 128 bits from the process's random generator (seeded from the OS): unique, not secret, and without
    # uuid4's system call per request.
    return f"{prefix}-{random.getrandbits(128):032x}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tandem"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


async def check_request(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                        params: SamplingParams, max_model_len: int) -> None:
    """What a request is checked for once its prompts are token ids and its parameters known, on the router and a
    worker alike: each prompt with max_tokens fits the context, and its structured output compiles."""
    chat = isinstance(body, ChatCompletionRequest)
    output_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    for ids in prompts:
        check_length(max_model_len, len(ids), params, body.prompt_param, output_param)
    await check_structured(params.structured, body.structured_param)
