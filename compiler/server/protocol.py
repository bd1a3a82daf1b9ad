"""OpenAI request models (pydantic, unknown fields refused) and the error JSON shape.

Fields map onto kiln's SamplingParams; ones the engine cannot honour (suffix, chat's echo) are refused with a 400
naming the field rather than silently ignored. logprobs (completions: 0 .. 20 top alternatives) and logprobs +
top_logprobs (chat) map onto SamplingParams.logprobs; presence / frequency penalties and logit_bias (OpenAI's:
string token ids) and vLLM's min_tokens onto the SamplingParams fields of those names. Completions' echo (the prompt
before the text, and with logprobs its tokens' logprobs before the output's; max_tokens 0: the prompt alone, as
lm-evaluation-harness asks for loglikelihoods) and vLLM's prompt_logprobs map onto SamplingParams.prompt_logprobs.
Chat's vLLM fields add_generation_prompt and continue_final_message go to the chat template (ChatTemplate.render).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.chat_template import message_text
from kiln.errors import KilnError, RequestError
from kiln.runtime.sampling_params import MAX_LOGPROBS, MAX_PENALTY, SamplingParams


class APIError(KilnError):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

    The one rule for a 400's code: the specific one given (context_length_exceeded, unknown_field, ...), else
    invalid_value when it names a parameter, as pydantic's range checks give; so no 400 naming a field has a null
    code, whichever route raised it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        if code is None and param is not None and status == 400:
            code = "invalid_value"
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def again(self) -> APIError:
        """A copy to raise: one error handed to many requests (a shutdown's) would pile up all their tracebacks."""
        return APIError(self.status, self.message, param=self.param, type=self.type, code=self.code,
                        headers=self.headers)


# OpenAI's types; a 404 (unknown model or route) is an invalid_request_error there too, with code model_not_found
# for a model.
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error", 500: "internal_error",
          503: "overloaded_error"}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def request_error(e: RequestError, param: str | None = None) -> APIError:
    """The 400 for a RequestError (the engine's and SamplingParams' checks), coded by APIError's rule: the error's
    own code, else invalid_value when it names a parameter. param: the field as this request names it (default:
    the error's)."""
    return APIError(400, str(e), param=param or e.param, code=e.code)


# Strict: a JSON true is not max_tokens 1, nor "3" the number 3 (ints still pass where floats are expected).
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions. An explicit null means the default, as in OpenAI's API."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 means off, as in vLLM
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # kiln / vLLM extension: each choice also carries its token ids
    include_stop_str_in_output: bool = False  # vLLM extension: keep the stop string (or stop token's text)
    stop_token_ids: list[int] | None = None  # vLLM extension: token ids that end the choice ("stop")
    # kiln extension, SamplingParams.speculate: false opts this request out of speculative decoding, true speculates
    # seeded sampling too; unset, a server started with --speculation speculates all but seeded sampling.
    speculate: bool | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # OpenAI's form: {"token id as a string": bias in -100 .. 100}; ids are checked against the vocabulary
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension: no eos, stop id or stop string before this many
    prompt_logprobs: int | None = None  # vLLM extension: the prompt tokens' logprobs (not streamed, as vLLM)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams, n included: SamplingParams.choices() makes its n requests."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
        return SamplingParams(temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty, max_tokens=max_tokens,
                              seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos,
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logprobs=self.engine_logprobs(), speculate=self.speculate,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias=self.token_logit_bias(), min_tokens=self.min_tokens, n=self.n,
                              prompt_logprobs=self.engine_prompt_logprobs(),
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

    def check(self) -> None:
        super().check()
        self.check_logprobs(self.logprobs, "logprobs")
        if self.suffix:
            raise APIError(400, "suffix is not supported; omit suffix", param="suffix")
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
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # A tool-calling conversation's history, handed to the chat template as they come (kiln makes no tool calls
    # itself: a request's `tools` field is refused, but a template that renders past calls gets them).
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg

    def text(self) -> str:
        """The content as text (kiln.chat_template.message_text, LLM.chat's too); a non-text part is a 400."""
        try:
            return message_text(self.content)
        except RequestError as e:
            raise request_error(e) from None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # vLLM's chat echo prepends the last message to the reply when it is the assistant's; kiln does not, so only
    # false is taken.
    echo: bool = False
    # vLLM extensions, handed to the chat template as transformers' apply_chat_template takes them: the assistant
    # header that opens the reply, or (continue_final_message) a prompt that ends inside the final assistant message,
    # which the reply continues (a "prefill").
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        super().check()
        self.check_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true; set logprobs or omit top_logprobs",
                           param="top_logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported on chat completions; omit echo (with continue_final_message "
                           "the reply continues the final message: put its text before the reply yourself), or send "
                           "the conversation as a prompt to /v1/completions with echo", param="echo")
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

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
