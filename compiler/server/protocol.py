"""OpenAI request models (pydantic) and the error JSON shape.

Fields map onto kiln's SamplingParams; ones the engine cannot honour (suffix, chat's echo) are refused with a 400
naming the field rather than silently ignored. Fields beyond kiln's own are sorted by kiln.server.fields: metadata is
accepted and ignored (each name logged once per server), fields that would change the output and that kiln cannot
honour are a 400 saying kiln does not support them, and anything else is an unknown field (a typo), refused with the
closest known one. logprobs (completions: 0 .. 20 top alternatives) and logprobs + top_logprobs (chat) map onto
SamplingParams.logprobs; presence / frequency penalties and logit_bias (OpenAI's: string token ids) and vLLM's
min_tokens onto the SamplingParams fields of those names. Completions' echo (the prompt before the text, and with
logprobs its tokens' logprobs before the output's; max_tokens 0: the prompt alone, as lm-evaluation-harness asks for
loglikelihoods) and vLLM's prompt_logprobs map onto SamplingParams.prompt_logprobs. Chat's vLLM fields
add_generation_prompt and continue_final_message go to the chat template (ChatTemplate.render).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from kiln.chat_template import check_template_kwargs, message_text
from kiln.errors import RequestError
from kiln.runtime.sampling_params import MAX_LOGPROBS, MAX_PENALTY, SamplingParams
from kiln.server.errors import APIError, error_body, request_error
from kiln.server.fields import (
    CHAT_IGNORED,
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    IGNORED,
    MESSAGE_IGNORED,
    sort_fields,
)

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "error_body", "request_error"]

# vLLM's bounds (VLLM_MAX_COMPLETION_PROMPTS, VLLM_MAX_N_SEQUENCES defaults): prompts in one completions request, n.
MAX_PROMPTS = 1024
MAX_N = 16384


def ignored_sink(info: ValidationInfo) -> set[str] | None:
    """Where a request's ignored field names go: the set the route passed as validation context["ignored"]."""
    return info.context.get("ignored") if isinstance(info.context, dict) else None


# Strict: a JSON true is not max_tokens 1, nor "3" the number 3 (ints still pass where floats are expected).
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far (prompt + completion tokens)
    continuous_usage_stats: bool = False

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return sort_fields({k: v for k, v in data.items() if v is not None}, cls.model_fields,
                           where="stream_options.")


class _Body(BaseModel):
    """A request body. An explicit null means the default, as in OpenAI's API; fields beyond the model's are sorted
    by kiln.server.fields (_IGNORED: accepted and dropped, _UNSUPPORTED: refused unless they ask for nothing)."""

    model_config = _STRICT
    _IGNORED: ClassVar[dict[str, str]] = {}
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any, info: ValidationInfo) -> Any:
        """Nulls are the defaults; metadata is dropped (its names go to the route's sink), an unsupported field
        that asks for something or an unknown one is a 400 (kiln.server.fields)."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        sink = ignored_sink(info)
        data = sort_fields(data, cls.model_fields, ignored=cls._IGNORED, unsupported=cls._UNSUPPORTED, sink=sink)
        return cls._nested_fields(data, sink)

    @classmethod
    def _nested_fields(cls, data: dict, sink: set[str] | None) -> dict:
        return data

    model: str | None = None

    def check(self) -> None:
        """The checks across fields, after pydantic's of each (a 400 naming the field)."""


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    _IGNORED: ClassVar[dict[str, str]] = IGNORED
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = COMPLETION_UNSUPPORTED

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 means off, as in vLLM
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM extension: each choice also carries its token ids, and its prompt's (prompt_token_ids)
    return_token_ids: bool = False
    # vLLM extension: logprobs name tokens "token_id:ID" instead of their text
    return_tokens_as_token_ids: bool = False
    include_stop_str_in_output: bool = False  # vLLM extension: keep the stop string (or stop token's text)
    stop_token_ids: list[int] | None = None  # vLLM extension: token ids that end the choice ("stop")
    # kiln extension, SamplingParams.speculate: false opts this request out of speculative decoding, true speculates
    # seeded sampling too; unset, a server started with --speculation speculates all but seeded sampling.
    speculate: bool | None = None
    # vLLM extension: the response's id is cmpl- / chatcmpl- and this (an X-Request-Id header wins, as in vLLM)
    request_id: str | None = Field(default=None, min_length=1)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # OpenAI's form: {"token id as a string": bias in -100 .. 100}; ids are checked against the vocabulary
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension: no eos, stop id or stop string before this many
    prompt_logprobs: int | None = None  # vLLM extension: the prompt tokens' logprobs (not streamed, as vLLM)
    # vLLM extensions, SamplingParams' fields of those names: special tokens' text kept in the output (false), and
    # then whether spaces go between two of them; the only token ids that may be sampled; keep the prompt's last k
    # tokens (-1: the last max_model_len)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None

    # The request fields a model's generation_config.json may give a default for (LoadedModel.generation_defaults,
    # keyed by SamplingParams field: the same names here); max_tokens is applied by the route.
    _DEFAULTED: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

    def sampling_params(self, max_tokens: int, defaults: dict[str, object] | None = None) -> SamplingParams:
        """The request's SamplingParams, n included: SamplingParams.choices() makes its n requests. defaults: the
        model's generation_config.json sampling (vLLM's --generation-config auto), for the fields the client left
        unset (or sent as null); a value the client sent wins."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
        sampling = {k: getattr(self, k) for k in self._DEFAULTED}
        sampling.update({k: v for k, v in (defaults or {}).items() if k in sampling and k not in self.model_fields_set})
        sampling["top_k"] = max(sampling["top_k"], 0)  # -1 means off, as in vLLM
        return SamplingParams(**sampling, max_tokens=max_tokens,
                              seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos,
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logprobs=self.engine_logprobs(), speculate=self.speculate,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias=self.token_logit_bias(), min_tokens=self.min_tokens, n=self.n,
                              prompt_logprobs=self.engine_prompt_logprobs(),
                              skip_special_tokens=self.skip_special_tokens,
                              spaces_between_special_tokens=self.spaces_between_special_tokens,
                              allowed_token_ids=None if self.allowed_token_ids is None else
                              tuple(self.allowed_token_ids),
                              truncate_prompt_tokens=self.truncate_prompt_tokens,
                              output_kind="delta")  # see streaming.Choices

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (OpenAI sends the ids as JSON object keys, so strings)."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise APIError(400, f"logit_bias key {key!r} is not a token id; keys are token ids written as "
                               'strings, e.g. {"50256": -100}', param="logit_bias", code="invalid_value")
            out[int(key)] = bias
        return out

    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many top alternatives each token reports."""
        return None

    def shown_prompt_logprobs(self) -> int | None:
        """How many top alternatives the response's prompt_logprobs field shows per prompt token (None: no field).
        Streamed responses have none (a stream refuses prompt_logprobs > 0, as vLLM's)."""
        return None if self.stream else self.prompt_logprobs

    def engine_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: what the response shows of the prompt (None: nothing)."""
        return self.shown_prompt_logprobs()

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options applies to streamed responses only; set stream: true or omit "
                           "stream_options", param="stream_options")
        self.check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        k = self.truncate_prompt_tokens
        if k is not None and (k == 0 or k < -1):  # as vLLM's
            raise APIError(400, f"truncate_prompt_tokens = {k} is out of range; allowed: an integer k >= 1 (keep the "
                           "prompt's last k tokens) or -1 (its last max_model_len)", param="truncate_prompt_tokens",
                           code="invalid_value")
        if self.stream and self.prompt_logprobs:  # vLLM's rule: 0 is accepted (and shows nothing)
            raise APIError(400, "prompt_logprobs is not available with stream: true (as in vLLM); ask without "
                           "stream, or use echo with logprobs on /v1/completions", param="prompt_logprobs")

    @staticmethod
    def check_logprobs(value: int | None, name: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{name} = {value} is out of range; allowed: an integer 0 .. {MAX_LOGPROBS} (how "
                           "many most likely tokens to report beside each token's own)", param=name,
                           code="invalid_value")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: the prompt alone (with its logprobs), as OpenAI's legacy API and vLLM
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = None
    echo: bool = False  # the prompt before the text; with logprobs, its tokens' logprobs before the output's
    suffix: str | None = None
    # OpenAI's: sample best_of and return the n most likely; kiln returns what it samples, so only best_of == n
    best_of: int | None = Field(default=None, ge=1)
    # vLLM extension: a text prompt gets the special tokens the tokenizer adds (Llama's BOS), as vLLM's default
    add_special_tokens: bool = True

    def check(self) -> None:
        super().check()
        self.check_logprobs(self.logprobs, "logprobs")
        if self.suffix:
            raise APIError(400, "suffix is not supported; omit suffix", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of = {self.best_of} is less than n = {self.n}; allowed: best_of >= n (the "
                           "choices returned come from the ones sampled)", param="best_of", code="invalid_value")
        if self.best_of is not None and self.best_of > self.n:
            raise APIError(400, f"kiln does not support best_of > n (best_of = {self.best_of}, n = {self.n}): it "
                           "returns every choice it samples and does not rank them; omit best_of, or ask for n = "
                           f"{self.best_of} choices and pick among them", param="best_of",
                           code="unsupported_parameter")
        if isinstance(self.prompt, list) and len(self.prompt) > MAX_PROMPTS and not isinstance(self.prompt[0], int):
            raise APIError(400, f"prompt is a list of {len(self.prompt)} prompts, over the limit of {MAX_PROMPTS} in "
                           "one request (vLLM's VLLM_MAX_COMPLETION_PROMPTS default); split it over several requests",
                           param="prompt", code="invalid_value")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens = 0 generates nothing; it is allowed only with echo: true (the prompt "
                           "alone, with its logprobs when logprobs is set); give max_tokens >= 1",
                           param="max_tokens", code="invalid_value")

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the response is the prompt alone (the engine samples one token, not shown)."""
        return self.echo and self.max_tokens == 0

    def shown_prompt_logprobs(self) -> int | None:
        """As vLLM's: the field is there too when echo with logprobs scored the prompt (showing that many)."""
        if self.stream or self.prompt_logprobs is not None:
            return super().shown_prompt_logprobs()
        return self.logprobs if self.echo else None

    def engine_prompt_logprobs(self) -> int | None:
        """As vLLM: prompt_logprobs, or with echo the logprobs count, whichever shows more."""
        counts = [c for c in (self.shown_prompt_logprobs(), self.logprobs if self.echo else None) if c is not None]
        return max(counts) if counts else None

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch: text, token ids, a list of texts or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; give text or at least one token id", param="prompt")
        return list(p)

    def engine_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = _STRICT
    # Any role, as in vLLM: the chat template decides what it means (and may refuse it with raise_exception).
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # A tool-calling conversation's history, handed to the chat template as they come (kiln makes no tool calls
    # itself: a request's `tools` field is refused, but a template that renders past calls gets them).
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


class _Conversation(_Body):
    """A conversation for the chat template (chat completions, /tokenize's messages form)."""

    @classmethod
    def _nested_fields(cls, data: dict, sink: set[str] | None) -> dict:
        if "messages" in data:
            data["messages"] = sort_message_fields(data["messages"], sink)
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

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any] | None:
        """The extra template variables: chat_template_kwargs, with reasoning_effort when given (it wins, as in
        vLLM); a variable the renderer sets itself (messages, add_generation_prompt) is a 400."""
        kwargs = dict(self.chat_template_kwargs or {})
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

    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # vLLM's chat echo prepends the last message to the reply when it is the assistant's; kiln does not, so only
    # false is taken.
    echo: bool = False

    def check(self) -> None:
        _Sampling.check(self)
        self.check_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true; set logprobs or omit top_logprobs",
                           param="top_logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported on chat completions; omit echo (with continue_final_message "
                           "the reply continues the final message: put its text before the reply yourself), or send "
                           "the conversation as a prompt to /v1/completions with echo", param="echo")
        _Conversation.check(self)

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# vLLM's /tokenize and /detokenize (kiln.server.app).


class TokenizeCompletionRequest(_Body):
    prompt: str
    add_special_tokens: bool = True  # the special tokens the tokenizer adds (Llama's BOS), as vLLM's default
    return_token_strs: bool = False  # also each token's string in the vocabulary (token_strs)


class TokenizeChatRequest(_Conversation):
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {"tools": CHAT_UNSUPPORTED["tools"]}

    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]
