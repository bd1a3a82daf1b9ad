"""/v1/chat/completions' request model, ChatCompletionRequest: its messages (ChatMessage, sort_message_fields), its
tools (Tool, sort_tool_fields) and tool_choice, the conversation the chat template renders (_Conversation, which
/tokenize's messages form shares) and chat's logprobs.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from kiln.chat_template import check_template_kwargs, message_text
from kiln.errors import RequestError
from kiln.server.errors import APIError, request_error
from kiln.server.fields import CHAT_IGNORED, CHAT_UNSUPPORTED, MESSAGE_IGNORED, sort_fields, tool_choice_error
from kiln.server.request_base import _STRICT, _Body, _Sampling


class ChatMessage(BaseModel):
    model_config = _STRICT
    # Any role, as in vLLM: the chat template decides what it means (and may refuse it with raise_exception).
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # A tool-calling conversation's history, handed to the chat template as they come (kiln makes no tool calls
    # itself, but a template that renders past calls gets them, as it gets the request's tools).
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An assistant message's reasoning (vLLM's field, or its deprecated reasoning_content), given to the template
    # under both names as vLLM gives it: a template that renders earlier reasoning (Qwen3's) reads one of them.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None and self.role == "assistant":  # as vLLM: an assistant's reasoning only
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        return msg

    def text(self) -> str:
        """The content as text (kiln.chat_template.message_text, LLM.chat's too); a non-text part is a 400."""
        try:
            return message_text(self.content)
        except RequestError as e:
            raise request_error(e) from None


def sort_message_fields(messages: Any, sink: set[str] | None) -> Any:
    """Each message without the fields no template reads (MESSAGE_IGNORED; their names to `sink`); a null extra is
    dropped, an unknown one (a typo) is a 400 naming the closest field."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, dict):
            msg = {k: v for k, v in msg.items() if v is not None or k in ChatMessage.model_fields}
            msg = sort_fields(msg, ChatMessage.model_fields, ignored=MESSAGE_IGNORED, where=f"messages.{i}.",
                              ignored_as="messages[].", sink=sink)
        out.append(msg)
    return out


class ToolFunction(BaseModel):
    """A tool's function, as OpenAI's schema and vLLM's FunctionDefinition give it."""

    model_config = _STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    """A tool definition, {"type": "function", "function": {...}}: OpenAI's only kind in chat completions (type may be
    left out, as vLLM's ChatCompletionToolsParam defaults it)."""

    model_config = _STRICT
    type: Literal["function"] = "function"
    function: ToolFunction

    def template_tool(self) -> dict[str, Any]:
        """The tool as the chat template sees it: as vLLM's server hands it over (its ChatCompletionToolsParam's
        model_dump()): type and function, the function's name, description and parameters (null when not given),
        and strict when given."""
        fn = self.function
        function: dict[str, Any] = {"name": fn.name, "description": fn.description, "parameters": fn.parameters}
        if fn.strict is not None:
            function["strict"] = fn.strict
        return {"type": self.type, "function": function}


def sort_tool_fields(tools: Any) -> Any:
    """Each tool (and its function) without its null fields (the defaults); a tool of another type than "function"
    (OpenAI's custom tools) is a 400, as is an unknown field (a typo: the 400 names the closest one)."""
    if not isinstance(tools, list):
        return tools
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict):
            kind = tool.get("type")
            if kind is not None and kind != "function":
                raise APIError(400, f'tools.{i}.type must be "function", not {kind!r}: kiln takes function tools, '
                               '{"type": "function", "function": {"name": ..., "description": ..., "parameters": '
                               '...}}, as vLLM does', param=f"tools.{i}.type", code="invalid_value")
            tool = sort_fields({k: v for k, v in tool.items() if v is not None}, Tool.model_fields,
                               where=f"tools.{i}.")
            if isinstance(tool.get("function"), dict):
                tool["function"] = sort_fields({k: v for k, v in tool["function"].items() if v is not None},
                                               ToolFunction.model_fields, where=f"tools.{i}.function.")
        out.append(tool)
    return out


class _Conversation(_Body):
    """A conversation for the chat template (chat completions, /tokenize's messages form)."""

    @classmethod
    def _nested_fields(cls, data: dict, sink: set[str] | None) -> dict:
        if "messages" in data:
            data["messages"] = sort_message_fields(data["messages"], sink)
        if "tools" in data:
            data["tools"] = sort_tool_fields(data["tools"])
        return data

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM extensions, handed to the chat template as transformers' apply_chat_template takes them: the assistant
    # header that opens the reply, or (continue_final_message) a prompt that ends inside the final assistant message,
    # which the reply continues (a "prefill").
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM extensions: the rendered prompt gets the tokenizer's special tokens on top of the template's own (false by
    # default, as vLLM and transformers' apply_chat_template(tokenize=True): the template writes BOS itself); a
    # template (its text) for this request instead of the server's (vLLM's: only with --trust-request-chat-template);
    # more variables for the template (e.g. Qwen3's {"enable_thinking": false}).
    add_special_tokens: bool = False
    chat_template: str | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning effort, handed to the template as the variable reasoning_effort (as vLLM hands it over)
    reasoning_effort: str | None = Field(default=None, min_length=1)
    # Tool definitions, handed to the template as the variable tools (template_tools) for it to render into the
    # prompt, as vLLM hands them over; kiln parses no tool calls out of the reply (chat: tool_choice "none" only).
    tools: list[Tool] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the template sees them (Tool.template_tool), or None for none ([] included)."""
        return [tool.template_tool() for tool in self.tools] if self.tools else None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The extra template variables: tools, then chat_template_kwargs, then reasoning_effort when given, each
        winning over the ones before, as in vLLM (a chat_template_kwargs key tools replaces the request's tools: vLLM
        lays the request's chat_template_kwargs over the variables it sets, tools among them); a variable the
        renderer sets itself (messages, add_generation_prompt) is a 400."""
        tools = self.template_tools()
        kwargs = {"tools": tools} if tools else {}
        kwargs.update(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        try:
            return check_template_kwargs(kwargs) if kwargs else None
        except RequestError as e:
            raise request_error(e) from None

    def request_template(self) -> str | None:
        """The template text this request brings (chat_template, else chat_template_kwargs' chat_template, as vLLM
        reads either), or None."""
        if self.chat_template is not None:
            return self.chat_template
        inner = (self.chat_template_kwargs or {}).get("chat_template")
        if inner is not None and not (isinstance(inner, str) and inner):
            raise APIError(400, "chat_template_kwargs.chat_template must be a template's text", param="chat_template")
        return inner

    def check(self) -> None:
        if self.continue_final_message:
            self.check_continue()

    def check_continue(self) -> None:
        # As in vLLM, whose transformers refuses the pair: add_generation_prompt defaults to true, so it must be
        # turned off explicitly.
        if self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true "
                           "(add_generation_prompt defaults to true, as in vLLM); to continue the final message set "
                           "add_generation_prompt: false, to start a new assistant message omit "
                           "continue_final_message", param="continue_final_message")
        last = self.messages[-1]  # whoever's: transformers and vLLM continue any final message
        if last.content is None:  # transformers refuses it too: no text to continue
            raise APIError(400, "continue_final_message: the final message has no content to continue; give it "
                           'text (an empty string "" continues from the start of the reply)', param="messages")


class ChatCompletionRequest(_Sampling, _Conversation):
    _IGNORED: ClassVar[dict[str, str]] = CHAT_IGNORED
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = CHAT_UNSUPPORTED
    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"tool_choice"})  # null is no tool choice, as vLLM takes it

    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's name for max_tokens (deprecated there), which it overrides
    # vLLM's chat echo prepends the last message to the reply when it is the assistant's; kiln does not, so only
    # false is taken.
    echo: bool = False
    # "none" (or null): the template renders the tools and the reply is text; kiln takes no other (tool_choice_error)
    tool_choice: str | dict[str, Any] | None = None

    def check_fields(self) -> None:
        _Sampling.check_fields(self)
        if self.max_completion_tokens is not None and self.max_tokens is not None and self.max_tokens < 1:
            # overridden, so SamplingParams never sees it; still a bad value, as OpenAI's schema says
            raise APIError(400, f"max_tokens = {self.max_tokens} is out of range: it must be at least 1 (or omitted: "
                           "max_completion_tokens overrides it)", param="max_tokens")
        self.check_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true; set logprobs or omit top_logprobs",
                           param="top_logprobs")
        err = tool_choice_error(self.tool_choice, sent="tool_choice" in self.model_fields_set, tools=bool(self.tools))
        if err is not None:
            raise err
        if self.echo:
            raise APIError(400, "echo is not supported on chat completions; omit echo (with continue_final_message "
                           "the reply continues the final message: put its text before the reply yourself), or send "
                           "the conversation as a prompt to /v1/completions with echo", param="echo")
        _Conversation.check(self)

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens, as in OpenAI and vLLM."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def unset_limit(self, max_tokens: int) -> tuple[str, str]:
        return "max_completion_tokens", (f"the {max_tokens} tokens the context leaves after the messages (no "
                                         "max_completion_tokens given)")

    def param_name(self, param: str | None) -> str | None:
        if param == "prompt":  # chat has no prompt: it was made from the messages
            return "messages"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param
