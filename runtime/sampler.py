"""The token sampler: SamplingParams (kiln.runtime.sampling_params) applied to logits.

The order of logit processing follows vLLM (apply_penalties): logit_bias, then the repetition, frequency and
presence penalties, and min_tokens' and allowed_token_ids' masks; then temperature, min-p, top-k, top-p (vLLM V1's
order: HF's puts min-p last, which differs when top-p follows it), and one draw from the remaining distribution.
Temperature 0 means greedy (argmax after the penalties).

Extreme but valid parameters must not overflow: the temperature divides log-probabilities (max exactly 0, so
the result is never NaN), a temperature below TEMPERATURE_FLOOR is greedy, and penalised logits are clamped to a
finite range. Non-finite model logits are flagged per row on the device and come back with the sampled tokens
in the same host copy, so detecting them costs no extra synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.runtime.sampling_params import SamplingParams

_LOGIT_LIMIT = 1e30  # penalised logits are clamped to +-this: finite, and far beyond any real logit gap


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
    presence_penalty * (count > 0) subtracted, eos / stop_token_ids at -inf while the output is shorter than
    min_tokens, and every token outside allowed_token_ids (when set) at -inf. vLLM masks before the penalties;
    masking last gives the same logits (the penalties keep -inf at -inf) without the repetition penalty's clamp
    making a masked logit finite.

    Sync-free on CUDA like apply_repetition_penalty: ids reach the device without a blocking copy, and counts
    are an index_add (bincount would read the max id back to size its output).
    """
    dev = logits.device
    # the output's ids reach the device once, for the repetition and the frequency / presence penalties alike
    out = to_device(_ids(history.output), dev) if params.reads_history else None
    if params.logit_bias:
        ids = to_device(torch.tensor(list(params.logit_bias), dtype=torch.long), dev)
        bias = to_device(torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype), dev)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1.0:
        seen = torch.cat([to_device(_ids(history.prompt), dev), out])
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and history.num_output:
        counts = torch.zeros_like(logits).index_add_(0, out, torch.ones(out.shape, dtype=logits.dtype, device=dev))
        # vLLM's two subtractions, in the logits' dtype (fp32), as OpenAI defines them
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    if history.num_output < params.min_tokens:
        held = tuple(history.eos_token_ids) + params.stop_token_ids
        if held:
            logits = logits.index_fill(0, to_device(torch.tensor(held, dtype=torch.long), dev), float("-inf"))
    if params.allowed_token_ids is not None:  # only these ids can be drawn (vLLM's first processor; see above)
        allowed = to_device(torch.tensor(params.allowed_token_ids, dtype=torch.long), dev)
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev).index_fill_(0, allowed, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a blocking copy (a pageable host -> CUDA copy waits for the stream)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on [N, V] fp32 logits, in vLLM V1's order (min-p is one of its
    argmax-invariant logits processors, which run before top-k / top-p: top-p's mass is taken over what min-p
    kept); the result is log-probabilities (up to a per-row constant), with filtered entries -inf.

    Temperature divides log_softmax(logits), whose row maximum is exactly 0, so any temperature > 0 leaves the
    maximum at 0 and the rest in [-inf, 0]: no overflow to NaN, however small the temperature.
    """
    logits = logits.log_softmax(dim=-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.min_p > 0.0:
        # In log space: p_i < min_p * p_max  <=>  logp_i < log(min_p) + logp_max.
        logp = logits.log_softmax(dim=-1)
        threshold = math.log(params.min_p) + logp.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(logp < threshold, float("-inf"))
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
    row's params (temperature, min-p, top-k, top-p; one-hot on the argmax for greedy rows). apply_penalties is not
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
