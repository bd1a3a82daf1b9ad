"""Uncached reference generation over a Level-1 graph.

Slow on purpose: every step recomputes the whole sequence, so nothing here can drift from the graph's
full-sequence semantics. This is the oracle the KV-cache pass and the runtime are checked against.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from kiln.runtime.request_checks import check_params_for_model, check_prompt
from kiln.runtime.sampler import TokenHistory, make_generator, sample
from kiln.runtime.sampling_params import SamplingParams


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only; a stop/eos token that ended generation is included
    finish_reason: str  # "length" | "stop"
    ttft_s: float  # time to the first generated token
    decode_tokens_per_s: float  # tokens after the first / time after the first (0.0 with one token)
    prompt_len: int


def _device(gm: fx.GraphModule) -> torch.device:
    return gm.get_parameter("embed.weight").device


def vocab_size(gm: fx.GraphModule) -> int:
    return gm.get_parameter("embed.weight").shape[0]


def forward_logits(gm: fx.GraphModule, token_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, T, vocab] for token_ids [B, T] at positions 0..T-1."""
    tokens = token_ids.to(device=_device(gm), dtype=torch.long)
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).expand(b, t).contiguous()
    with torch.inference_mode():
        return gm(tokens, positions).float()


def _check_request(prompt_ids: Sequence[int], params: SamplingParams, context: int, vocab: int) -> list[int]:
    params.validate()
    ids = check_prompt(prompt_ids, params.max_tokens, vocab=vocab, limit=context)
    check_params_for_model(params, vocab)
    return ids


def generate(
    gm: fx.GraphModule,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    context: int,
    eos_token_ids: Sequence[int] = (),
) -> Generation:
    """Generate up to params.max_tokens tokens (None: to the context) after `prompt_ids`, recomputing the full
    sequence each step.

    Stops early (finish_reason "stop") on a token in params.stop_token_ids, or in eos_token_ids unless
    params.ignore_eos. With params.seed set the result is reproducible. Penalties, logit_bias and min_tokens apply
    as in the engine (sampler.apply_penalties); stop strings are the engine's alone (this path has no text).
    Tokens only: logprobs and prompt_logprobs are not computed here (the engine's are checked against
    transformers' log_softmax in tests/runtime). A max_tokens past the context is refused here (as the server and
    `kiln run` refuse it), where the engine behind LLM cuts it to the context: an oracle asked for more tokens than
    fit would otherwise compare a different request.
    """
    _check_request(prompt_ids, params, context, vocab_size(gm))
    max_tokens = context - len(prompt_ids) if params.max_tokens is None else params.max_tokens
    device = _device(gm)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    generator = make_generator(params.seed, device)
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    out: list[int] = []
    finish = "length"
    start = time.perf_counter()
    first_at = start
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = forward_logits(gm, ids[None])[0, -1]
            history = TokenHistory(ids[: len(prompt_ids)], out, tuple(eos_token_ids))
            tok = sample(logits, params, generator, prev_tokens=history)
            if not out:
                first_at = time.perf_counter()
            out.append(tok)
            ids = torch.cat([ids, ids.new_tensor([tok])])
            if tok in stops:
                finish = "stop"
                break
    end = time.perf_counter()
    decode_s = end - first_at
    rate = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else 0.0
    return Generation(out, finish, first_at - start, rate, len(prompt_ids))
