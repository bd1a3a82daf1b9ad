"""Incremental detokenization and stop strings for one request.

Decoding every output token alone breaks multi-byte characters and the leading-space rules of BPE and
sentencepiece vocabularies, so (as TGI and vLLM do) we decode a small window twice: the tokens last turned
into text (the context) and the same window plus the pending tokens; the difference is the new text. A window
that ends in U+FFFD is an incomplete character, and we wait for more tokens. Pending tokens that add no text at
all (special tokens, or the ids above 255 of kiln's byte-level fallback, which a random-weight model emits
constantly) are dropped from the window, and an incomplete character is waited for over MAX_PENDING tokens at
most, so each token costs two decodes of a few tokens, not of everything since the last visible character.

Stop strings are searched only in the tail that a new delta can complete. While a request runs, the last
len(longest stop) - 1 characters are held back from streamed text, so text that a stop string later trims
is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.step import TokenizerLike

MAX_PENDING = 8  # tokens an incomplete character may wait for before its replacement character is emitted


class Detokenizer:
    def __init__(self, tokenizer: TokenizerLike | None, stop: Sequence[str] = (),
                 token_text: dict[int, str] | None = None, include_stop: bool = False, min_tokens: int = 0):
        """token_text: a cache of decode([id]) that detokenizers of one tokenizer share (the engine's), filled as
        they go: a one-token context, what most windows start from, is then decoded once per id, not per use.
        include_stop: a stop string found stays at the end of the text (else the text ends before it).
        min_tokens: stop strings are searched only from the token after the min_tokens-th on (vLLM's rule, the
        one eos follows too: it can be sampled once min_tokens tokens are out), in the text that token completes."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._token_text = token_text
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self._context: list[int] = []  # the tokens whose text was emitted last: context for the next delta
        self._context_text: str | None = None  # their text alone (decoded once, when first needed)
        self._pending: list[int] = []  # tokens whose text is not emitted yet (an incomplete character)

    def add(self, token_id: int) -> str | None:
        """Add one generated token; return the stop string it completed (the text is trimmed there), else None."""
        self.tokens.append(token_id)
        if self.tokenizer is None:
            return None
        self._pending.append(token_id)
        before = len(self.text)
        self.text += self._delta(final=False)
        return self._find_stop(before) if self.stop and len(self.tokens) > self.min_tokens else None

    def flush(self) -> None:
        """At the end of the request: emit what the window held back (an incomplete character included)."""
        if self.tokenizer is not None and self._pending:
            before = len(self.text)
            self.text += self._delta(final=True)
            if len(self.tokens) > self.min_tokens:
                self._find_stop(before)

    def visible_text(self, final: bool) -> str:
        if final or not self._hold:
            return self.text
        return self.text[: max(len(self.text) - self._hold, 0)]

    def _delta(self, final: bool) -> str:
        assert self.tokenizer is not None
        if self._context_text is None:
            cache = self._token_text
            if cache is not None and len(self._context) == 1:
                tok = self._context[0]
                text = cache.get(tok)
                if text is None:
                    text = cache[tok] = self.tokenizer.decode(self._context)
                self._context_text = text
            else:
                self._context_text = self.tokenizer.decode(self._context)
        prefix_text = self._context_text
        new_text = self.tokenizer.decode(self._context + self._pending)
        # A character is at most 4 bytes (4 byte tokens): pending longer than MAX_PENDING is not a character that
        # is still coming but broken text (or bytes interleaved with tokens that have none), emitted as it is.
        complete = final or not new_text.endswith("\ufffd") or len(self._pending) > MAX_PENDING
        if len(new_text) > len(prefix_text) and complete:
            self._context, self._context_text, self._pending = self._pending, None, []
            return new_text[len(prefix_text) :]
        if new_text == prefix_text:  # the pending tokens add nothing, in this context: drop them from the window
            self._pending = []
        return ""

    def _find_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        start = max(before - self._hold, 0)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        idx, s = min(found)
        self.text = self.text[: idx + len(s) if self.include_stop else idx]
        return s
