"""vLLM's Logprob: what logprobs and prompt_logprobs report for one token at one position."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability at one position, from the model's raw log_softmax (before temperature and the
    other logit processors, as vLLM v1 reports it).

    rank: 1 for the most likely token; as vLLM counts it, the number of tokens at least as likely (the top-k
    alternatives have ranks 1 .. k). decoded_token: the token's text alone, tokenizer.decode([id]) (None when the
    engine has no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # one position: the top-k alternatives by rank, then the chosen token
