"""Engine log-probabilities in the OpenAI shapes: the completions API's legacy {"tokens", "token_logprobs",
"top_logprobs", "text_offset"} and chat's {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.

The engine gives one {token_id: Logprob} per generated token: the sampled token first, then the top-k by rank (vLLM
v1's order; runtime.logprob.top_logprobs picks the top n out of it). Values are the model's raw log_softmax
(before temperature), as vLLM v1 reports them. Echoed
prompt tokens come in the same shape (their first entry None: nothing comes before the first token); vLLM's
prompt_logprobs field has its own shape (prompt_logprobs_field).
"""

from __future__ import annotations

import codecs
import itertools
from dataclasses import dataclass, field

from kiln.runtime.logprob import PositionLogprobs, top_logprobs
from kiln.step import TokenizerLike

LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM reports masked tokens with this value too


@dataclass
class TokenLogprobs:
    """One choice's tokens with their log-probabilities, accumulated and formatted per delta."""

    tokenizer: TokenizerLike | None
    top_n: int  # how many top alternatives to show per token (chat's top_logprobs; completions' logprobs)
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens named "token_id:ID", not by their text
    entries: list[tuple[int, PositionLogprobs]] = field(default_factory=list)
    text_offset: int = 0  # completions: where the next token's text starts in the choice's text
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def token(self, token_id: int) -> str:
        """The token's text."""
        return token_text(self.tokenizer, token_id)

    def name(self, token_id: int) -> str:
        """How the response names the token: its text, or "token_id:ID" (as_ids)."""
        return f"token_id:{token_id}" if self.as_ids else self.token(token_id)

    def add(self, token_ids: list[int], logprobs: list[PositionLogprobs | None]
            ) -> list[tuple[int, PositionLogprobs | None]]:
        new = list(zip(token_ids, logprobs, strict=True))
        self.entries += new
        return new

    def completion(self, entries: list[tuple[int, PositionLogprobs | None]]) -> dict:
        """The legacy completions shape of `entries`, advancing text_offset past them. An entry without logprobs
        (an echoed prompt's first token) has null token_logprobs and top_logprobs, as in OpenAI's and vLLM's."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp in entries:
            text = self.token(tok)
            out["tokens"].append(self.name(tok))
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(_finite(lp[tok].logprob))
                top: dict[str, float] = {}
                # The top_n most likely (an echoed prompt's entries may hold more: prompt_logprobs asked for more),
                # then the token itself; keyed by text: of tokens that decode alike, the most likely one's value.
                for t, v in itertools.chain(top_logprobs(lp, self.top_n), ((tok, lp[tok]),)):
                    top.setdefault(self.name(t), _finite(v.logprob))
                out["top_logprobs"].append(top)
            # Offsets count the characters the bytes so far make: a token holding part of a character adds none
            # until the one that ends it (counting its "\ufffd" text would push every later offset along), and a
            # whole token's text ends what its bytes emit (an unfinished character before it comes out as U+FFFD).
            emitted = self._utf8.decode(self.token_bytes(tok))
            whole = text != "\ufffd" and emitted.endswith(text)
            out["text_offset"].append(self.text_offset + (len(emitted) - len(text) if whole else 0))
            self.text_offset += len(emitted)
        return out

    def chat(self, entries: list[tuple[int, PositionLogprobs]]) -> dict:
        """Chat's {"content": [...]} of `entries`; each token's top_logprobs lists the top_n most likely."""
        content = []
        for tok, lp in entries:
            top = [self._chat_entry(t, v.logprob) for t, v in top_logprobs(lp, self.top_n)]
            content.append({**self._chat_entry(tok, lp[tok].logprob), "top_logprobs": top})
        return {"content": content}

    def token_bytes(self, token_id: int) -> bytes:
        """What the token adds to the text as bytes; a token that holds part of a UTF-8 character decodes to
        U+FFFD, and its raw bytes let a client rejoin it."""
        raw = getattr(self.tokenizer, "token_bytes", None)
        return raw(token_id) if raw is not None else self.token(token_id).encode("utf-8")

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        # as_ids: the bytes of the name, as vLLM gives them (the token's own bytes would not spell it)
        raw = self.name(token_id).encode() if self.as_ids else self.token_bytes(token_id)
        return {"token": self.name(token_id), "logprob": _finite(logprob), "bytes": list(raw)}


def token_text(tokenizer: TokenizerLike | None, token_id: int) -> str:
    if tokenizer is None:  # served from token ids only: name the id, as vLLM's return_tokens_as_token_ids
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def prompt_logprobs_field(tokenizer: TokenizerLike | None, token_ids: list[int],
                          logprobs: list[PositionLogprobs | None], top_n: int) -> list[dict[int, dict] | None]:
    """vLLM's prompt_logprobs response field: None for the first token, then per prompt token {token id: {"logprob",
    "rank", "decoded_token"}} for the prompt token itself (first, as in vLLM v1) and the top_n most likely (ranks
    1 .. top_n); -inf is -9999.0, as vLLM clamps it. JSON makes the ids strings."""
    out: list[dict[int, dict] | None] = []
    for tok, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        shown = itertools.chain(((tok, lp[tok]),), top_logprobs(lp, top_n))  # the prompt token first, as vLLM v1
        out.append({t: {"logprob": _finite(v.logprob), "rank": v.rank, "decoded_token": token_text(tokenizer, t)}
                    for t, v in shown})
    return out


def _finite(value: float) -> float:
    return max(value, LOGPROB_FLOOR)
