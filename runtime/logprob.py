"""vLLM's Logprob: what logprobs and prompt_logprobs report for one token at one position."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


# One position, in vLLM v1's order: the chosen token (sampled, or the prompt's) first, then the top-k alternatives by
# rank; a chosen token among them keeps its first place, with its top-k entry's rank.
PositionLogprobs = dict[int, Logprob]


def position_logprobs(
    chosen: int,
    chosen_logprob: float,
    chosen_rank: int | None,
    top: Iterable[tuple[int, float]],
    text: Callable[[int], str | None] | None = None,
) -> PositionLogprobs:
    """One position's entries in vLLM v1's order: `chosen` first, then `top` ((token id, logprob) by rank, ranks 1,
    2, ...), an entry of `chosen` among them overwriting its value in place, as vLLM's dict does. text: decoded_token
    per id (None: not filled here)."""
    d = {chosen: Logprob(chosen_logprob, chosen_rank, text(chosen) if text is not None else None)}
    for r, (tok, lp) in enumerate(top):
        d[tok] = Logprob(lp, r + 1, text(tok) if text is not None else None)
    return d


def top_logprobs(entries: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The n most likely of a position's entries, in rank order (the top-k part of the dict, the chosen token
    included only when it is among them): what OpenAI's top_logprobs lists."""
    ranked = [(t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda item: item[1].rank)[:n]
