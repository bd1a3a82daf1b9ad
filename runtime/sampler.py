"""Sampling parameters and the token sampler.

The order of logit processing follows vLLM (apply_penalties): logit_bias, then the repetition, frequency and
presence penalties, and min_tokens' mask; then temperature, top-k, top-p, min-p (HF's order), and one draw from the
remaining distribution. Temperature 0 means greedy (argmax after the penalties).

Extreme but valid parameters must not overflow: the temperature divides log-probabilities (max exactly 0, so
the result is never NaN), a temperature below TEMPERATURE_FLOOR is greedy, and penalised logits are clamped to a
finite range. Non-finite model logits are flagged per row on the device and come back with the sampled tokens
in the same host copy, so detecting them costs no extra synchronisation.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from kiln.errors import RequestError

TEMPERATURE_FLOOR = 1e-5  # below this a temperature is greedy (as in vLLM): the draw would be argmax anyway
SEED_MAX = 2**64 - 1  # torch generators take 64-bit seeds
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for (as vLLM's default max_logprobs)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
_LOGIT_LIMIT = 1e30  # penalised logits are clamped to +-this: finite, and far beyond any real logit gap
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
    # vLLM's prompt_logprobs is not supported (the step graph computes logits at each sequence's last position
    # only); the field exists so that code ported from vLLM gets a RequestError saying so. Only None is valid.
    prompt_logprobs: int | None = None

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
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "top_k", "max_tokens", "seed", "logprobs",
                     "presence_penalty", "frequency_penalty", "min_tokens", "n"):
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

    def validate(self) -> SamplingParams:
        """Raise RequestError naming the first bad parameter, its value and the allowed range; return self."""
        # _finite rejects NaN and inf, which would slip through the range comparisons.
        checks = (
            (
                "temperature",
                self.temperature,
                _finite(self.temperature) and self.temperature >= 0,
                "temperature >= 0 (0 means greedy)",
            ),
            ("top_k", self.top_k, _is_int(self.top_k) and self.top_k >= 0,
             "an integer top_k >= 0 (0 or -1 means off)"),
            ("top_p", self.top_p, _finite(self.top_p) and 0 < self.top_p <= 1, "0 < top_p <= 1 (1 means off)"),
            ("min_p", self.min_p, _finite(self.min_p) and 0 <= self.min_p < 1, "0 <= min_p < 1 (0 means off)"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                _finite(self.repetition_penalty) and self.repetition_penalty > 0,
                "repetition_penalty > 0 (1 means off)",
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
                "a tuple of non-empty strings",
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
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"sampling parameter min_tokens = {self.min_tokens} is more than max_tokens = "
                               f"{self.max_tokens}; allowed: min_tokens <= max_tokens", param="min_tokens")
        if self.prompt_logprobs is not None:
            raise RequestError(f"sampling parameter prompt_logprobs = {self.prompt_logprobs!r} is not supported: "
                               "kiln's step graph computes logits only at each sequence's last position; leave it "
                               "None (logprobs, of the generated tokens, is supported)", param="prompt_logprobs")
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
        return (num_output < self.min_tokens or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

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


_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("top_k", "min_tokens", "n")
_OPTIONAL_INTS = ("seed", "logprobs", "max_tokens", "prompt_logprobs")
_BOOLS = ("ignore_eos", "include_stop_str_in_output")


def _wrong_type(name: str, value: object) -> tuple[str, object] | None:
    """(the type `name` must have, the offending value or item) when `value` has another type; None when its type
    is right (then only its range is wrong)."""
    if name in _NUMBERS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else ("a number", value)
    if name in _INTS:
        return None if _is_int(value) else ("an integer", value)
    if name in _OPTIONAL_INTS:
        return None if value is None or _is_int(value) else ("an integer or None", value)
    if name in _BOOLS:
        return None if isinstance(value, bool) else ("a bool (True or False)", value)
    if name == "speculate":
        return None if value is None or isinstance(value, bool) else ("a bool or None", value)
    if name == "output_kind":
        return None if isinstance(value, str) else ("a string", value)
    if name == "logit_bias":
        if not isinstance(value, dict):
            return "a dict {token id: bias} or None", value
        bad_keys = [k for k in value if not _is_int(k)]
        if bad_keys:
            return "a dict whose keys are token ids (integers)", bad_keys[0]
        bad = [v for v in value.values() if isinstance(v, bool) or not isinstance(v, (int, float))]
        return ("a dict whose values are numbers", bad[0]) if bad else None
    if name in ("stop_token_ids", "stop"):
        kind = "token ids (integers)" if name == "stop_token_ids" else "strings"
        if not isinstance(value, tuple):
            return kind, value
        bad = [t for t in value if not (_is_int(t) if name == "stop_token_ids" else isinstance(t, str))]
        return (kind, bad[0]) if bad else None
    return None


def _plain(value: object) -> object:
    """A numpy scalar (np.float64, a float subclass, included) or 0-d tensor as the Python value it holds; anything
    else unchanged (validate() names it)."""
    if type(value) not in (bool, int, float, str) and value is not None and hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return value


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_tuple(value: object) -> object:
    """One token id or a sequence of them (lists, tuples, numpy arrays, tensors) as a tuple of ints; any other
    value unchanged, for validate() to name."""
    if isinstance(value, (str, bytes, bool)):
        return value
    try:
        return (operator.index(value),)
    except TypeError:
        pass
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        return value
    out = []
    for t in items:
        try:
            out.append(t if isinstance(t, bool) else operator.index(t))
        except TypeError:
            out.append(t)
    return tuple(out)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None (torch's global RNG) when the request has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def apply_repetition_penalty(logits: torch.Tensor, prev_tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF rule on [V] logits: seen tokens' positive logits are divided by `penalty`, negative ones multiplied.

    A mask instead of unique() keeps it free of host syncs; the result is clamped so that an extreme penalty
    (1e-300, 1e300) gives a huge but finite logit instead of inf or NaN.
    """
    if penalty == 1.0 or prev_tokens.numel() == 0:
        return logits
    ids = to_device(prev_tokens.to(dtype=torch.long), logits.device)
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device).index_fill_(0, ids, True)
    wide = logits.double()  # a Python float scalar divides in float64 too: 1e-300 stays 1e-300, not 0
    changed = torch.where(wide > 0, wide / penalty, wide * penalty).clamp(-_LOGIT_LIMIT, _LOGIT_LIMIT).to(logits.dtype)
    return torch.where(seen, changed, logits)


@dataclass(frozen=True)
class TokenHistory:
    """What apply_penalties reads from a request besides its SamplingParams: its prompt and output token ids (lists,
    tuples or 1-D tensors; the repetition penalty counts both, the presence and frequency penalties and min_tokens
    the output only) and the model's eos ids, which min_tokens holds back with params.stop_token_ids."""

    prompt: Sequence[int] | torch.Tensor = ()
    output: Sequence[int] | torch.Tensor = ()
    eos_token_ids: Sequence[int] = ()

    @property
    def num_output(self) -> int:
        return len(self.output)


_NO_HISTORY = TokenHistory()


def _ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """int64 host (or device) ids from a list, tuple or tensor."""
    if isinstance(tokens, torch.Tensor):
        return tokens.to(dtype=torch.long).reshape(-1)
    return torch.tensor(list(tokens), dtype=torch.long)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """[V] logits as vLLM's sampler leaves them before temperature: logit_bias added to the raw logits, then the
    repetition penalty (HF's rule, on prompt and output tokens), frequency_penalty * count(token in output) and
    presence_penalty * (count > 0) subtracted, and eos / stop_token_ids at -inf while the output is shorter than
    min_tokens. vLLM masks before the penalties; masking last gives the same logits (the penalties keep -inf at
    -inf) without the repetition penalty's clamp making a masked logit finite.

    Sync-free on CUDA like apply_repetition_penalty: ids reach the device without a blocking copy, and counts
    are an index_add (bincount would read the max id back to size its output).
    """
    dev = logits.device
    if params.logit_bias:
        ids = to_device(torch.tensor(list(params.logit_bias), dtype=torch.long), dev)
        bias = to_device(torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype), dev)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1.0:
        seen = torch.cat([to_device(_ids(history.prompt), dev), to_device(_ids(history.output), dev)])
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and history.num_output:
        out = to_device(_ids(history.output), dev)
        counts = torch.zeros_like(logits).index_add_(0, out, torch.ones(out.shape, dtype=logits.dtype, device=dev))
        # vLLM's two subtractions, in the logits' dtype (fp32), as OpenAI defines them
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    if history.num_output < params.min_tokens:
        held = tuple(history.eos_token_ids) + params.stop_token_ids
        if held:
            logits = logits.index_fill(0, to_device(torch.tensor(held, dtype=torch.long), dev), float("-inf"))
    return logits


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a blocking copy (a pageable host -> CUDA copy waits for the stream)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on [N, V] fp32 logits; the result is log-probabilities (up to a
    per-row constant), with filtered entries -inf.

    Temperature divides log_softmax(logits), whose row maximum is exactly 0, so any temperature > 0 leaves the
    maximum at 0 and the rest in [-inf, 0]: no overflow to NaN, however small the temperature.
    """
    logits = logits.log_softmax(dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        # Below the k-th largest value, as HF and vLLM: every token tied with the k-th is kept (keeping exactly k
        # would let topk's tie order decide which of them can be drawn).
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token is always kept.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # In log space: p_i < min_p * p_max  <=>  logp_i < log(min_p) + logp_max.
        logp = logits.log_softmax(dim=-1)
        threshold = math.log(params.min_p) + logp.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logp < threshold, float("-inf"))
    return logits


def sample_rows(rows: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                prev_tokens: Sequence[object] | None) -> torch.Tensor:
    """int64 [N] on the device, one token per row of finite fp32 [N, V] logits; no host sync. prev_tokens: per row
    a TokenHistory, or the tokens seen so far (prompt and output, all taken as prompt); None: nothing seen."""
    if prev_tokens is None:
        prev_tokens = [_NO_HISTORY] * rows.shape[0]
    histories = [h if isinstance(h, TokenHistory) else TokenHistory(h) for h in prev_tokens]
    if any(params.processes_logits(h.num_output) for h in histories):
        rows = torch.stack([apply_penalties(r, params, h) for r, h in zip(rows, histories, strict=True)])
    if params.greedy:
        return rows.argmax(dim=-1)
    return torch.multinomial(_draw_probs(rows, params), 1, generator=generator).squeeze(-1)


def _draw_probs(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy draw comes from: the one place sample_rows and processed_probs share."""
    return process_logits(rows, params).softmax(dim=-1)


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """fp32 [R, V]: for each row of fp32 [R, V] logits, exactly the distribution sample_rows draws from with that
    row's params (temperature, top-k, top-p, min-p; one-hot on the argmax for greedy rows). apply_penalties is not
    applied: speculation is off while it would change anything (Request.can_speculate). Rows with equal params are
    processed together.
    """
    rows = logits.float()
    out = torch.empty_like(rows)
    groups: dict[tuple, tuple[SamplingParams, list[int]]] = {}
    for i, p in enumerate(params):  # keyed by what processing reads, not by seeds or stop conditions
        groups.setdefault((p.greedy, p.temperature, p.top_k, p.top_p, p.min_p), (p, []))[1].append(i)
    for p, idx in groups.values():
        sel = torch.tensor(idx, dtype=torch.long, device=rows.device) if len(idx) < rows.shape[0] else None
        part = rows if sel is None else rows.index_select(0, sel)
        if p.greedy:
            probs = torch.zeros_like(part).scatter_(-1, part.argmax(dim=-1, keepdim=True), 1.0)
        else:
            probs = _draw_probs(part, p)
        if sel is None:
            out.copy_(probs)
        else:
            out.index_copy_(0, sel, probs)
    return out


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    prev_tokens: TokenHistory | torch.Tensor | Sequence[int] | Sequence[TokenHistory | Sequence[int]] | None = None,
) -> int | torch.Tensor:
    """Draw the next token from [V] logits (returns an int) or one per row of [N, V] logits (returns int64 [N]).

    `prev_tokens`, one for [V] logits, one per row for [N, V]: a TokenHistory (prompt, output and eos ids: every
    penalty and min_tokens), or the tokens seen so far (prompt and output), which serve the repetition penalty
    only (presence / frequency penalties and min_tokens count no output then).
    """
    single = logits.dim() == 1
    rows = logits.float().reshape(-1, logits.shape[-1])
    per_row = None
    if prev_tokens is not None:
        per_row = [prev_tokens] if single else list(prev_tokens)  # type: ignore[arg-type]
        if len(per_row) != rows.shape[0]:
            raise ValueError(f"prev_tokens has {len(per_row)} rows for {rows.shape[0]} rows of logits")
    out = sample_rows(rows, params, generator, per_row)
    return int(out[0]) if single else out
