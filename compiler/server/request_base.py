"""The request models' shared bases: _Body (strict; an explicit null is the default; fields beyond the model's are
sorted by kiln.server.fields) and _Sampling (the fields completions and chat completions share, mapped onto
SamplingParams), with StreamOptions and vLLM's bounds MAX_PROMPTS and MAX_N.

Pydantic checks types only, and bounds SamplingParams does not know (vLLM's MAX_N, OpenAI-only fields): a field
that maps onto a SamplingParams field is range-checked by SamplingParams.validate, so each rule has one message
(_Sampling.check runs it on the values as sent, before the prompt is tokenized).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from kiln.errors import RequestError
from kiln.runtime.sampling_params import MAX_LOGPROBS, SamplingParams
from kiln.server.errors import APIError, request_error
from kiln.server.fields import COMPLETION_UNSUPPORTED, IGNORED, sort_fields

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
    """A request body. An explicit null means the default, as in OpenAI's API (but for the fields in _NULL_KEPT,
    where null is a value of its own, as vLLM takes it); fields beyond the model's are sorted by kiln.server.fields
    (_IGNORED: accepted and dropped, _UNSUPPORTED: refused unless they ask for nothing)."""

    model_config = _STRICT
    _IGNORED: ClassVar[dict[str, str]] = {}
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {}
    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, data: Any, info: ValidationInfo) -> Any:
        """Nulls are the defaults (but _NULL_KEPT's); metadata is dropped (its names go to the route's sink), an
        unsupported field that asks for something or an unknown one is a 400 (kiln.server.fields)."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k in cls._NULL_KEPT}
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

    # The ranges of the fields SamplingParams has are its validate()'s (see the module docstring).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # -1 means off, as in vLLM (SamplingParams takes it)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, le=MAX_N)  # the server's bound (vLLM's); n >= 1 is SamplingParams'
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's form: {"token id as a string": bias in -100 .. 100}; ids are checked against the vocabulary
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0  # vLLM extension: no eos, stop id or stop string before this many
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

    def sampling_params(self, max_tokens: int | None, defaults: dict[str, object] | None = None) -> SamplingParams:
        """The request's SamplingParams, n included: SamplingParams.choices() makes its n requests. defaults: the
        model's generation_config.json sampling (vLLM's --generation-config auto), for the fields the client left
        unset (or sent as null); a value the client sent wins."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = {k: getattr(self, k) for k in self._DEFAULTED}
        sampling.update({k: v for k, v in (defaults or {}).items() if k in sampling and k not in self.model_fields_set})
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

    def requested_max_tokens(self) -> int | None:
        """The client's limit on the completion as SamplingParams.max_tokens takes it; None: not given."""
        return self.max_tokens

    def param_name(self, param: str | None) -> str | None:
        """A SamplingParams / engine parameter as this request names it (a RequestError's param)."""
        return param

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
        """The route's own checks (check_fields), then SamplingParams.validate on the values as sent (before the
        model's defaults, and prompt_logprobs before completions' echo merges it with logprobs): a bad value is
        refused before the prompt is tokenized, with SamplingParams' message naming the field."""
        self.check_fields()
        sent = dataclasses.replace(self.sampling_params(self.requested_max_tokens()),
                                   prompt_logprobs=self.prompt_logprobs)
        try:
            sent.validate(across=False)
        except RequestError as e:
            raise request_error(e, self.param_name(e.param)) from None
        self.check_min_tokens(self.requested_max_tokens())

    def check_min_tokens(self, max_tokens: int | None, is_default: bool = False, lead: str = "") -> None:
        """SamplingParams' min_tokens <= max_tokens, worded in this request's fields (the limit as the client set
        it, or what a default came to: is_default, the model's); a 400. max_tokens None: not known yet. lead names
        the prompt of a batch, when the limit is what that prompt leaves of the context (none given, or a default)."""
        if max_tokens is None:
            return
        limit_value = 0 if self.prompt_only else max_tokens  # echo's max_tokens 0 generates nothing shown
        if self.min_tokens <= limit_value:
            return
        if self.limit_given():
            name = self.param_name("max_tokens")
            limit = f"{name} = {limit_value}"
        elif is_default:
            name = self.unset_limit(max_tokens)[0]
            limit = f"the {max_tokens} tokens of the model's default max_tokens that fit the context (no {name} given)"
        else:
            name, limit = self.unset_limit(max_tokens)
        lead = "" if self.limit_given() else lead  # a limit the client gave is the same for every prompt
        raise APIError(400, f"{lead}min_tokens = {self.min_tokens} is more than {limit}; allowed: min_tokens <= {name}",
                       param="min_tokens", code="invalid_value")

    def limit_given(self) -> bool:
        """Whether the client sent the limit on the completion (max_tokens, or chat's max_completion_tokens)."""
        return self.requested_max_tokens() is not None

    def unset_limit(self, max_tokens: int) -> tuple[str, str]:
        """(the field, what the limit was) for a request that set no max_tokens, as min_tokens' 400 names them."""
        return "max_tokens", f"max_tokens = {max_tokens} (the default; set max_tokens)"

    @property
    def prompt_only(self) -> bool:
        """Whether the response is the prompt alone (completions' echo with max_tokens 0)."""
        return False

    def check_fields(self) -> None:
        """The checks SamplingParams cannot make: fields of OpenAI's API alone, and how fields go together."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options applies to streamed responses only; set stream: true or omit "
                           "stream_options", param="stream_options")
        # vLLM's rule: 0 is accepted (and shows nothing); a value out of range is refused by SamplingParams' check
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs > 0:
            raise APIError(400, "prompt_logprobs is not available with stream: true (as in vLLM); ask without "
                           "stream, or use echo with logprobs on /v1/completions", param="prompt_logprobs")

    @staticmethod
    def check_logprobs(value: int | None, name: str) -> None:
        """An OpenAI-only count of top logprobs (chat's top_logprobs) in SamplingParams.logprobs' range."""
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{name} = {value} is out of range; allowed: an integer 0 .. {MAX_LOGPROBS} (how "
                           "many most likely tokens to report beside each token's own)", param=name,
                           code="invalid_value")
