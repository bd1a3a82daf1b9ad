"""Sampling parameters and the token sampler.

The order of logit processing follows HF transformers: repetition penalty, temperature, top-k, top-p, min-p,
then one draw from the remaining distribution. Temperature 0 means greedy (argmax after the penalty).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: generation ends when the text contains one (trimmed from the text)

    def __post_init__(self) -> None:
        # Accept a single stop string and lists for convenience; keep the stored fields hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

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
            ("top_k", self.top_k, _is_int(self.top_k) and self.top_k >= 0, "an integer top_k >= 0 (0 means off)"),
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
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "an integer max_tokens >= 1",
            ),
            ("seed", self.seed, self.seed is None or _is_int(self.seed), "an integer seed or None"),
            (
                "stop_token_ids",
                self.stop_token_ids,
                all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "a tuple of token ids >= 0",
            ),
            (
                "stop",
                self.stop,
                isinstance(self.stop, tuple) and all(isinstance(t, str) and t for t in self.stop),
                "a tuple of non-empty strings",
            ),
            ("ignore_eos", self.ignore_eos, isinstance(self.ignore_eos, bool), "True or False"),
        )
        for name, value, ok, allowed in checks:
            if not ok:
                raise RequestError(f"sampling parameter {name} = {value!r} is out of range; allowed: {allowed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None (torch's global RNG) when the request has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def apply_repetition_penalty(logits: torch.Tensor, prev_tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF rule on [V] logits: seen tokens' positive logits are divided by `penalty`, negative ones multiplied."""
    if penalty == 1.0 or prev_tokens.numel() == 0:
        return logits
    ids = prev_tokens.to(device=logits.device, dtype=torch.long).unique()
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on [N, V] fp32 logits; filtered entries become -inf."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).indices
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, kth, True)
        logits = logits.masked_fill(~keep, float("-inf"))
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
        probs = logits.softmax(dim=-1)
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    prev_tokens: torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> int | torch.Tensor:
    """Draw the next token from [V] logits (returns an int) or one per row of [N, V] logits (returns int64 [N]).

    `prev_tokens` are the tokens seen so far (prompt and output) for the repetition penalty: one sequence for
    [V] logits, one per row for [N, V].
    """
    single = logits.dim() == 1
    rows = logits.float().reshape(-1, logits.shape[-1])
    if params.repetition_penalty != 1.0 and prev_tokens is not None:
        per_row = [prev_tokens] if single else list(prev_tokens)
        if len(per_row) != rows.shape[0]:
            raise ValueError(f"prev_tokens has {len(per_row)} rows for {rows.shape[0]} rows of logits")
        rows = torch.stack(
            [
                apply_repetition_penalty(r, torch.as_tensor(p, dtype=torch.long), params.repetition_penalty)
                for r, p in zip(rows, per_row, strict=True)
            ]
        )
    if params.greedy:
        out = rows.argmax(dim=-1)
    else:
        probs = process_logits(rows, params).softmax(dim=-1)
        out = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return int(out[0]) if single else out


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prev_tokens: Sequence[Sequence[int]],
) -> list[int]:
    """One token per row of [R, V] logits, each row with its own request's parameters and generator.

    Greedy rows without a repetition penalty share one argmax; every other row is drawn alone with its own
    generator, so a seeded request gives the same tokens whatever else is in the batch.
    """
    rows = logits.float()
    out = [0] * rows.shape[0]
    plain = [i for i, p in enumerate(params) if p.greedy and p.repetition_penalty == 1.0]
    if plain:
        idx = torch.tensor(plain, device=rows.device)
        for i, tok in zip(plain, rows.index_select(0, idx).argmax(dim=-1).tolist(), strict=True):
            out[i] = tok
    done = set(plain)
    for i, p in enumerate(params):
        if i not in done:
            out[i] = int(sample(rows[i], p, generators[i], prev_tokens=prev_tokens[i]))
    return out
