"""OpenAI API request and response models, shared by the worker server and the router.

Requests are validated strictly (a string where a number belongs is a 400, as with OpenAI) but
unknown fields are ignored so that newer SDKs keep working.
"""

from __future__ import annotations

import random
import time
from functools import cached_property
from typing import Annotated, ClassVar, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from tandem.errors import APIError
from tandem.openai.structured_output import ANY_JSON_OBJECT, MAX_SPEC_CHARS, choice_spec, json_schema_spec
from tandem.openai.structured_output import check as check_structured
from tandem.openai.tool_calls import ParsedToolCalls, ToolCallMode, resolve, template_tool_calls
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


class _Request(BaseModel):
    # No Infinity or NaN, which Python's JSON parser takes but orjson (the workers' parser) does not.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator(*NULL_MEANS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value, info):
        """OpenAI types these "X or null", and SDKs send null for an argument given as None: the default."""
        return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: SkipJsonSchema[bool | None] = None  # vLLM's, not implemented: refused (_sampling)


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
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


class _CommonParams(_Request):
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
        return _bounded(spec, param)

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


PositiveInt = Annotated[int, Field(ge=1)]


class CompletionRequest(_CommonParams):
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
        max_tokens = 1 if self.echo_only else _max_tokens(self.max_tokens, default_max_tokens)
        return self._sampling(max_tokens, self.logprobs, vocab_size, prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0


# -- function calling's request models (tandem.openai.tool_calls serves them) ----------------------------------------


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    """A call an assistant message made, as a client sends it back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back in the conversation
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @model_validator(mode="after")
    def _content_given(self):
        # OpenAI's schema: only an assistant's message may leave its content out (one that called tools).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatPrompt(_Request):
    """A conversation and how the chat template renders it: chat completions' prompt, and /tokenize's."""

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's, as transformers' apply_chat_template takes them.
    add_generation_prompt: bool = Field(True, description="open an assistant turn after the messages (ext.)")
    continue_final_message: bool = Field(False, description="leave the last message open, for the model to go on "
                                                            "with it: an assistant answer begun by the client (ext.)")
    chat_template_kwargs: dict | None = Field(None, description="more variables for the chat template, e.g. "
                                                                "enable_thinking (ext.)")
    tools: list[Tool] | None = None  # shown to the chat template; chat completions call them (tandem.openai.tool_calls)

    def template_messages(self) -> list[dict]:
        messages = []
        for m in self.messages:
            message = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = template_tool_calls(m.tool_calls)
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        return messages

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template is shown."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def prompt_text(self, tokenizer) -> str:
        """The conversation rendered by the model's chat template. A template that refuses it (Llama 2's and
        Mistral's raise_exception when roles do not alternate) refuses the client's input: a 400, not a 500."""
        if not tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false (the last message goes "
                                "on; no new turn opens)", param="continue_final_message")
        extra = dict(self.chat_template_kwargs or {})
        tools = self.template_tools()
        reserved = {"messages", "add_generation_prompt", "continue_final_message"} | ({"tools"} if tools else set())
        taken = sorted(set(extra) & reserved)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs")
        if tools:
            extra["tools"] = tools
        messages = self.template_messages()
        if "developer" not in tokenizer.chat_template:  # OpenAI's newer name for the system role
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if self.continue_final_message:  # marked, to cut the rendered text right after it (as transformers does)
            messages[-1]["content"] += _OPEN_END
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=self.add_generation_prompt,
                                                 variables=extra)
        except jinja2.TemplateError as exc:
            raise APIError(400, f"the model's chat template refused the conversation: {exc}",
                           param="messages") from None
        except (TypeError, ValueError, AttributeError, LookupError) as exc:
            if not self.chat_template_kwargs:
                raise
            # Most likely a variable of the client's that the template cannot use (a number where it loops), though
            # the messages may share the blame: the message names both.
            raise APIError(400, f"the model's chat template failed on these messages with these "
                                f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None
        return _left_open(text) if self.continue_final_message else text


class ChatCompletionRequest(ChatPrompt, _CommonParams):
    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "smollm2", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Say hello."}]}]})
    prompt_param: ClassVar[str] = "messages"

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: SkipJsonSchema[bool] = False  # vLLM's, on chat: not implemented, refused (sampling_params)
    functions: list | None = None  # function calling's older spelling: refused

    # The server's --tool-call-parser (None: it has none), which serves tool_choice "auto": the server's setting,
    # not the client's, so no field of the body.
    _tool_call_parser: str | None = PrivateAttr(None)

    def use_tool_call_parser(self, parser: str | None) -> None:
        """Set by the server before anything reads the tool choice."""
        self._tool_call_parser = parser
        self.__dict__.pop("_tool_calls", None)  # resolved again, with the parser

    @cached_property
    def _tool_calls(self) -> tuple[ToolCallMode | ParsedToolCalls | None, dict | None]:
        return resolve(self.tools, self.tool_choice, self.parallel_tool_calls, self._tool_call_parser)

    def tool_call_mode(self) -> ToolCallMode | ParsedToolCalls | None:
        """How the output becomes tool calls (None: it is the answer's text); a 400 for tools it cannot serve."""
        return self._tool_calls[0]

    @property
    def structured_param(self) -> str | None:
        # A tools schema that does not compile is the tools' fault.
        return "tools" if self._tool_calls[1] is not None else super().structured_param

    def structured_output(self):
        _, schema = self._tool_calls
        if schema is None:  # text, or "auto": the output is the request's own to constrain
            return super().structured_output()
        other = super().structured_param
        if other is not None:
            raise APIError(400, f"this tool_choice constrains the output to tool calls; leave out {other}",
                           param="tool_choice")
        return _bounded(json_schema_spec(schema), "tools", "parameter schemas")

    def sampling_params(self, default_max_tokens: int, vocab_size: int) -> SamplingParams:
        """`vocab_size` bounds the token ids of logit_bias."""
        if self.functions:
            raise APIError(400, "functions (the older spelling of function calling) are not supported; use tools",
                           param="functions")
        if self.top_logprobs is not None and not self.logprobs:  # as OpenAI and vLLM answer it
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported on chat completions", param="echo")
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(_max_tokens(getattr(self, name), default_max_tokens, name), top, vocab_size)


def _bounded(spec: StructuredOutput, param: str, what: str = "schema, regex, grammar or choices") -> StructuredOutput:
    """The spec, or a 400 naming `param` when it is past what is compiled."""
    if len(spec.value) > MAX_SPEC_CHARS:
        raise APIError(400, f"{param}: at most {MAX_SPEC_CHARS} characters of {what} are accepted, got "
                            f"{len(spec.value)}", param=param)
    return spec


_OPEN_END = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, so that both cut a conversation alike


def _left_open(rendered: str) -> str:
    """The rendered conversation cut where the final message's text ends (its _OPEN_END marker), as transformers'
    apply_chat_template does with continue_final_message: whatever the template closes the message with (an
    end-of-turn token) goes, so the model writes on in that message."""
    at = rendered.rfind(_OPEN_END.strip())
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not keep the last message's text",
                       param="continue_final_message")
    if rendered[at:at + len(_OPEN_END)] == _OPEN_END:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space, so the marker's too


def _max_tokens(requested: int | None, default: int, param: str = "max_tokens") -> int:
    if requested is None:
        return default
    if requested <= 0:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
    return requested


# -- checks against the served model, the same on the router and on a worker ----------------------------------


def check_model(served_name: str, model: str | None) -> None:
    if model is not None and model != served_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served_name}'",
                       param="model", code="model_not_found")


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
