"""Chat completion requests: the conversation, how the model's chat template renders it, and function calling's
request models (tandem.openai.tool_calls serves them)."""

from __future__ import annotations

from functools import cached_property
from typing import ClassVar, Literal

import jinja2
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from pydantic.json_schema import SkipJsonSchema

from tandem.errors import APIError
from tandem.openai.params import CommonParams, RequestModel, bounded, max_tokens_or_default
from tandem.openai.structured_output import json_schema_spec
from tandem.openai.tool_calls import ParsedToolCalls, ToolCallMode, resolve, template_tool_calls
from tandem.protocol import SamplingParams


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    """A call an assistant message made, as a client sends it back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
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


class ChatPrompt(RequestModel):
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


class ChatCompletionRequest(ChatPrompt, CommonParams):
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
        return bounded(json_schema_spec(schema), "tools", "parameter schemas")

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
        return self._sampling(max_tokens_or_default(getattr(self, name), default_max_tokens, name), top, vocab_size)


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
