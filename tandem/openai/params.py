"""What chat and text completion requests share: the strict request base, the sampling parameters both take
(OpenAI's and vLLM's), the vLLM parameters refused rather than ignored, and the bounds on what they ask for.

Requests are validated strictly (a string where a number belongs is a 400, as with OpenAI) but
unknown fields are ignored so that newer SDKs keep working.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from tandem.errors import APIError
from tandem.openai.structured_output import ANY_JSON_OBJECT, MAX_SPEC_CHARS, choice_spec, json_schema_spec
from tandem.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutput,
    TokenId,
)

MAX_N = 128  # completions per prompt: OpenAI's bound on n
MAX_LOGIT_BIAS = 300  # biased tokens per request: each costs the worker work at every step
# Parameters with a default other than null, which a client may still send as null (each model declares its own).
NULL_MEANS_DEFAULT = ("n", "stream", "echo", "logprobs", "ignore_eos", "include_stop_str_in_output", "include_usage",
                      "presence_penalty", "frequency_penalty", "add_generation_prompt", "continue_final_message",
                      "skip_special_tokens", "spaces_between_special_tokens")


class RequestModel(BaseModel):
    # No Infinity or NaN, which Python's JSON parser takes but orjson (the workers' parser) does not.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator(*NULL_MEANS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value, info):
        """OpenAI types these "X or null", and SDKs send null for an argument given as None: the default."""
        return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: SkipJsonSchema[bool | None] = None  # vLLM's, not implemented: refused (_sampling)


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict | bool | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="a Lark or GBNF grammar")
    json_object: bool | None = None


# Parameters of vLLM's that are not implemented, refused when set (to anything but null or false) rather than
# ignored, with what to use instead. (And stream_options.continuous_usage_stats, and `echo` on chat.)
_REFUSED = {
    "use_beam_search": "", "truncate_prompt_tokens": "",
    "prompt_logprobs": "; completions give the prompt's logprobs with echo: true and logprobs",
    "guided_json": "; use structured_outputs: {\"json\": ...} or response_format",
    "guided_regex": "; use structured_outputs: {\"regex\": ...}",
    "guided_choice": "; use structured_outputs: {\"choice\": [...]}",
    "guided_grammar": "; use structured_outputs: {\"grammar\": ...}",
    "allowed_token_ids": "; logit_bias favours or bans up to 300 tokens",
    "bad_words": "; logit_bias bans tokens (-100), stop ends the answer at a string",
    "return_tokens_as_token_ids": "",
    "chat_template": "; the model's own template renders every chat (chat_template_kwargs gives it variables)",
}
# Where vLLM's own default is neither null nor false: a client that sends it asks for nothing.
_VLLM_DEFAULTS = {"bad_words": []}
# The same for those whose default is true: refused when false. (HF's tokenizers put no spaces between special
# tokens in any case.)
_REFUSED_WHEN_FALSE = ("spaces_between_special_tokens",)


def refusal(name: str) -> APIError:
    """The 400 for one of the _REFUSED parameters, set."""
    return APIError(400, f"{name} is not supported{_REFUSED[name]}", param=name)


class CommonParams(RequestModel):
    model: str | None = Field(None, description="the served model's name; optional, as in vLLM: there is one")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N, description="completions to generate for each prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # int64, as vLLM bounds it
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100], "
                                                              "added to its logit")
    response_format: ResponseFormat | None = None
    # Extensions that vLLM users rely on.
    structured_outputs: StructuredOutputs | None = None
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="drop tokens less likely than min_p x the "
                                                                   "likeliest one (ext.)")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text (ext.)")
    # vLLM extensions not implemented here: declared so that one set to anything but its default is refused
    # (_REFUSED) rather than ignored, and left out of the schema, which lists what is served.
    use_beam_search: SkipJsonSchema[bool | None] = None
    truncate_prompt_tokens: SkipJsonSchema[int | None] = None
    prompt_logprobs: SkipJsonSchema[int | None] = None
    guided_json: SkipJsonSchema[dict | str | None] = None
    guided_regex: SkipJsonSchema[str | None] = None
    guided_choice: SkipJsonSchema[list | None] = None
    guided_grammar: SkipJsonSchema[str | None] = None
    allowed_token_ids: SkipJsonSchema[list | None] = None
    bad_words: SkipJsonSchema[list | None] = None
    return_tokens_as_token_ids: SkipJsonSchema[bool | None] = None
    chat_template: SkipJsonSchema[str | None] = None
    spaces_between_special_tokens: SkipJsonSchema[bool] = True

    @property
    def usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if isinstance(v, list) and any(s == "" for s in v) or v == "":
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v):
        if len(v or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(v)}")
        for token, bias in (v or {}).items():
            # One spelling per id ("5", not "05"), so that no two keys add up on one token past the bound.
            if not (token.isascii() and token.isdigit() and str(int(token)) == token):
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must lie in [-100, 100], got {bias} for token {token}")
        return v

    @property
    def structured_param(self) -> str | None:
        """The parameter the request's structured output comes from, for its errors."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs" if self.structured_outputs is not None else None

    def structured_output(self) -> StructuredOutput | None:
        """The constraint the request puts on its whole output (tandem.openai.structured_output): a 400 naming the
        parameter when it is malformed or too large. Whether its schema, regex or grammar compiles is for
        tandem.openai.structured_output.check, off the event loop."""
        fmt, vllm = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text":
            if vllm is not None:
                raise APIError(400, "set response_format or structured_outputs, not both", param="structured_outputs")
            param = "response_format"
            if fmt.type == "json_object":
                spec = json_schema_spec(ANY_JSON_OBJECT)
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema", param=param)
            else:
                spec = json_schema_spec(fmt.json_schema.schema_)
        elif vllm is not None:
            param = "structured_outputs"
            given = {name: value for name, value in vllm if value is not None and value is not False}
            if len(given) != 1:
                names = sorted(StructuredOutputs.model_fields[name].alias or name for name in given)
                raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar and "
                                    f"json_object; got {names or 'none'}", param=param)
            (name, value), = given.items()
            if name == "json_":
                spec = json_schema_spec(value)
            elif name == "json_object":
                spec = json_schema_spec(ANY_JSON_OBJECT)
            elif name == "choice":
                spec = choice_spec(value)
            else:
                spec = StructuredOutput(kind=name, value=value)
        else:
            return None
        return bounded(spec, param)

    def _sampling(self, max_tokens: int, logprobs: int | None, vocab_size: int,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        bias = [(int(token), value) for token, value in (self.logit_bias or {}).items()]
        if any(token >= vocab_size for token, _ in bias):
            raise APIError(400, f"logit_bias names a token id outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        if any(token >= vocab_size for token in self.stop_token_ids or []):  # one that could never come: a typo
            raise APIError(400, f"stop_token_ids names a token id outside the vocabulary [0, {vocab_size})",
                           param="stop_token_ids")
        if (self.min_tokens or 0) > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                           param="min_tokens")
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer it
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        for name in _REFUSED:
            value = getattr(self, name)
            if value is not None and value is not False and value != _VLLM_DEFAULTS.get(name):
                raise refusal(name)
        for name in _REFUSED_WHEN_FALSE:
            if getattr(self, name) is False:
                raise APIError(400, f"{name}: false is not supported", param=name)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported; include_usage gives the "
                                "usage once, at the end", param="stream_options.continuous_usage_stats")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            min_tokens=self.min_tokens or 0,
            structured=self.structured_output(),
            prompt_logprobs=prompt_logprobs,
        )


def bounded(spec: StructuredOutput, param: str, what: str = "schema, regex, grammar or choices") -> StructuredOutput:
    """The spec, or a 400 naming `param` when it is past what is compiled."""
    if len(spec.value) > MAX_SPEC_CHARS:
        raise APIError(400, f"{param}: at most {MAX_SPEC_CHARS} characters of {what} are accepted, got "
                            f"{len(spec.value)}", param=param)
    return spec



def max_tokens_or_default(requested: int | None, default: int, param: str = "max_tokens") -> int:
    if requested is None:
        return default
    if requested <= 0:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    return requested
