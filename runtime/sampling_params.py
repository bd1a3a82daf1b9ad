"""What a request asks of sampling: SamplingParams (checked by validate(), every bad value named with its allowed
range), the n > 1 rule (choices()) and check_stop. Plain data and checks, no tensors: the sampler that applies them
is kiln.runtime.sampler; the helpers that convert and type-check values are in kiln.runtime.sampling_checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from kiln.errors import RequestError
from kiln.runtime.sampling_checks import _finite, _int_tuple, _is_int, _plain, _wrong_type

TEMPERATURE_FLOOR = 1e-5  # below this a temperature is greedy (as in vLLM): the draw would be argmax anyway
SEED_MAX = 2**64 - 1  # torch generators take 64-bit seeds
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for (as vLLM's default max_logprobs)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
# What each RequestOutput of a request carries (vLLM's RequestOutputKind): "cumulative", everything so far every
# step (with what is new in the delta_* fields); "delta", only what is new (token_ids, text and logprobs equal the
# delta_* fields); "final_only", one output when the request ends, with everything. The last two spare the host
# copying every request's growing output each step: LLM.generate and the throughput benchmark ask for final_only,
# the HTTP server for delta.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 (or any value below TEMPERATURE_FLOOR = 1e-5) is greedy; seed is an
    integer in 0 .. 2**64 - 1; stop_token_ids accepts one id or any sequence of ids (numpy and torch included).
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = off (-1, vLLM's "off", is taken as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # None: as many as the context (the engine's max_model_len) leaves after the prompt (set when added)
    max_tokens: int | None = 16
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: generation ends when the text contains one (trimmed from the text)
    # True keeps the stop string, or the text of the stop token (eos or stop_token_ids), at the end of the text
    include_stop_str_in_output: bool = False
    # None: off; 0: the sampled token's log-probability; k: also the k most likely tokens' (see sample_batch)
    logprobs: int | None = None
    # Speculative decoding (an engine with a drafter): False opts this request out; None (the default) lets it
    # speculate unless it samples with a seed, whose tokens would then depend on whether speculation ran for it
    # (it turns itself off in large batches): a seed gives the same tokens in any batch. True speculates even then.
    # It is also off for requests with logprobs, penalties, logit_bias, or fewer outputs than min_tokens (see
    # Request.can_speculate).
    speculate: bool | None = None
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS
    # vLLM's (and OpenAI's) penalties on the generated tokens only, in [-2, 2], 0 = off: each token's logit loses
    # frequency_penalty * (its count in the output) + presence_penalty * (1 if it is in the output at all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # eos and stop_token_ids cannot be sampled (their logits are -inf) until the request has min_tokens output tokens,
    # and a stop string ends it only through a later token (as in vLLM; eos is held back with ignore_eos too, as there)
    min_tokens: int = 0
    # {token id: bias in [-100, 100]} added to the raw logits before the penalties (a copy is kept; hash ignores it)
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    # The Python API and the server fan SamplingParams(n=k) out into k requests (choices()); the engine serves one.
    n: int = 1
    # vLLM's prompt_logprobs. None: off; k: for every prompt position after the first, the prompt token's
    # log-probability there and the k most likely tokens' (RequestOutput.prompt_logprobs; the first position has
    # none, so it is None). Prefix caching does not skip the prompt positions still to be scored.
    prompt_logprobs: int | None = None
    # vLLM's detokenizer options: False keeps special tokens' text (eos, <|im_end|>, ...) in the text, where stop
    # strings see it too; spaces_between_special_tokens False (with skip_special_tokens False) drops the spaces a
    # tokenizer puts between two added tokens, as vLLM's fast detokenizer does
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: only these token ids may be sampled (the others' logits are -inf, before any other processing); ids
    # are checked against the vocabulary when the request is added. None: any token
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: keep only the prompt's last k tokens (left truncation); -1: the last max_model_len; None: the whole
    # prompt (a prompt too long for the context is refused)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        # Accept a single stop string / token id, lists, arrays and numpy scalars for convenience; keep the stored
        # fields plain Python values and hashable tuples. Anything that does not convert is left for validate().
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _int_tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _int_tuple(self.allowed_token_ids))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "top_k", "max_tokens", "seed", "logprobs",
                     "presence_penalty", "frequency_penalty", "min_tokens", "n", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if isinstance(self.logit_bias, dict):  # a copy: the caller's dict may change after the request is added
            object.__setattr__(self, "logit_bias", {_plain(k): _plain(v) for k, v in self.logit_bias.items()})
        if _is_int(self.top_k) and self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)

    @classmethod
    def coerce(cls, value: object, what: str = "sampling_params") -> SamplingParams:
        """A SamplingParams, None (the defaults) or a dict of its fields; RequestError names anything else."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise RequestError(f"{what} has unknown field(s) {', '.join(map(repr, unknown))}; known fields: "
                                   f"{', '.join(sorted(known))}")
            return cls(**value)
        raise RequestError(f"{what} must be a SamplingParams or a dict of its fields, not {type(value).__name__}")

    def validate(self, *, across: bool = True) -> SamplingParams:
        """Raise RequestError naming the first bad parameter, its value and the allowed range; return self.
        across=False checks each value alone and leaves min_tokens <= max_tokens out (the server words that rule
        in its request's fields: max_completion_tokens, or the limit a default gave)."""
        # _finite rejects NaN and inf, which would slip through the range comparisons (inf is >= 0: a range open
        # above says "finite").
        checks = (
            (
                "temperature",
                self.temperature,
                _finite(self.temperature) and self.temperature >= 0,
                "a finite temperature >= 0 (0 means greedy)",
            ),
            ("top_k", self.top_k, _is_int(self.top_k) and self.top_k >= 0,
             "an integer top_k >= -1 (0 or -1 means off)"),  # __post_init__ made -1 a 0
            ("top_p", self.top_p, _finite(self.top_p) and 0 < self.top_p <= 1, "0 < top_p <= 1 (1 means off)"),
            ("min_p", self.min_p, _finite(self.min_p) and 0 <= self.min_p <= 1,
             "0 <= min_p <= 1 (0 means off; 1 keeps only the most likely tokens)"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                _finite(self.repetition_penalty) and self.repetition_penalty > 0,
                "a finite repetition_penalty > 0 (1 means off)",
            ),
            (
                "max_tokens",
                self.max_tokens,
                self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                "an integer max_tokens >= 1, or None (up to the context)",
            ),
            (
                "seed",
                self.seed,
                self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= SEED_MAX),
                "an integer seed in 0 .. 2**64 - 1, or None",
            ),
            (
                "stop_token_ids",
                self.stop_token_ids,
                isinstance(self.stop_token_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "token ids >= 0: one id or a sequence of them",
            ),
            (
                "stop",
                self.stop,
                isinstance(self.stop, tuple) and all(isinstance(t, str) and t for t in self.stop),
                "non-empty strings: one or a sequence of them",
            ),
            ("ignore_eos", self.ignore_eos, isinstance(self.ignore_eos, bool), "True or False"),
            ("speculate", self.speculate, self.speculate is None or isinstance(self.speculate, bool),
             "True, False or None (speculate unless seeded sampling)"),
            ("include_stop_str_in_output", self.include_stop_str_in_output,
             isinstance(self.include_stop_str_in_output, bool), "True or False"),
            ("output_kind", self.output_kind, self.output_kind in OUTPUT_KINDS,
             " or ".join(repr(k) for k in OUTPUT_KINDS)),
            (
                "logprobs",
                self.logprobs,
                self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"None (off), or an integer 0 .. {MAX_LOGPROBS}: how many top log-probabilities besides the "
                "sampled token's",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs,
                self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                 and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"None (off), or an integer 0 .. {MAX_LOGPROBS}: how many top log-probabilities besides the prompt "
                "token's, at each prompt position",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                _finite(self.presence_penalty) and -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
                "-2 <= presence_penalty <= 2 (0 means off)",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                _finite(self.frequency_penalty) and -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
                "-2 <= frequency_penalty <= 2 (0 means off)",
            ),
            ("min_tokens", self.min_tokens, _is_int(self.min_tokens) and self.min_tokens >= 0,
             "an integer min_tokens >= 0 (0 means off), at most max_tokens"),
            (
                "logit_bias",
                self.logit_bias,
                self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                    _is_int(k) and k >= 0 and _finite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
                    for k, v in self.logit_bias.items())),
                "None, or a dict {token id >= 0: bias}, each bias -100 <= bias <= 100",
            ),
            ("n", self.n, _is_int(self.n) and self.n >= 1, "an integer n >= 1 (completions per prompt)"),
            ("skip_special_tokens", self.skip_special_tokens, isinstance(self.skip_special_tokens, bool),
             "True or False"),
            ("spaces_between_special_tokens", self.spaces_between_special_tokens,
             isinstance(self.spaces_between_special_tokens, bool), "True or False"),
            (
                "allowed_token_ids",
                self.allowed_token_ids,
                self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, tuple) and self.allowed_token_ids
                                                   and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
                "None (any token), or a non-empty sequence of token ids >= 0: the only ones that may be sampled",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens,
                self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                        and (self.truncate_prompt_tokens >= 1
                                                             or self.truncate_prompt_tokens == -1)),
                "None (off), an integer k >= 1 (keep the prompt's last k tokens), or -1 (its last max_model_len)",
            ),
        )
        for name, value, ok, allowed in checks:
            if ok:
                continue
            wrong = _wrong_type(name, value)
            if wrong:  # a wrong type is not a value out of range: say which type is wanted and which came
                kind, bad = wrong
                got = type(bad).__name__ if bad is value else f"{type(bad).__name__} {bad!r}"
                raise RequestError(f"sampling parameter {name} = {value!r} must be {kind}, not {got}; "
                                   f"allowed: {allowed}", param=name)
            raise RequestError(f"sampling parameter {name} = {value!r} is out of range; allowed: {allowed}",
                               param=name)
        if across and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"sampling parameter min_tokens = {self.min_tokens} is more than max_tokens = "
                               f"{self.max_tokens}; allowed: min_tokens <= max_tokens", param="min_tokens")
        return self

    def choices(self) -> list[SamplingParams]:
        """The n single-sequence requests SamplingParams(n=k) stands for (validated; [self] when n is 1), each with
        n = 1. With a seed, choice i samples with seed + i (mod 2**64: seeds are 64-bit, so 2**64 - 1 is followed by
        0): the choices differ and the whole stays reproducible; unseeded choices draw from torch's global
        generator and differ anyway. The one rule for n > 1: LLM.generate / generate_stream and the server use it.
        """
        self.validate()
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % (SEED_MAX + 1))
                for i in range(self.n)]

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's tokens (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def processes_logits(self, num_output: int) -> bool:
        """Whether apply_penalties changes anything for a request with num_output tokens generated so far."""
        return (num_output < self.min_tokens or self.reads_history or bool(self.logit_bias)
                or self.allowed_token_ids is not None)

    @property
    def may_process_logits(self) -> bool:
        """Whether apply_penalties can change anything for this request at some step (then the sampler needs its
        TokenHistory on every step, to know which)."""
        return self.processes_logits(0)

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR


def check_stop(
    token: int, num_output: int, params: SamplingParams, eos_token_ids: Sequence[int] = ()
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) when the token just generated ends the request, else None.

    A stop token id or eos (unless ignore_eos) gives "stop"; reaching max_tokens gives "length". Stop strings
    need the text, so the detokenizer checks those.
    """
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return "stop", token
    if num_output >= params.max_tokens:
        return "length", None
    return None
