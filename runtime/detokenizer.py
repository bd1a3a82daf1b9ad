"""Incremental detokenization and stop strings for one request.

Decoding every output token alone breaks multi-byte characters and the leading-space rules of BPE and
sentencepiece vocabularies, so (as TGI and vLLM do) we decode a small window twice: the tokens already turned
into text (prefix) and the same window plus the new tokens; the difference is the new text. A window that
ends in U+FFFD is an incomplete character, and we wait for more tokens.

Stop strings are searched only in the tail that a new delta can complete. While a request runs, the last
len(longest stop) - 1 characters are held back from streamed text, so text that a stop string later trims
is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.step import TokenizerLike


class Detokenizer:
    def __init__(self, tokenizer: TokenizerLike | None, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # tokens[_prefix:_read] were decoded as context for the next delta
        self._read = 0

    def add(self, token_id: int) -> str | None:
        """Add one generated token; return the stop string it completed (the text is trimmed there), else None."""
        self.tokens.append(token_id)
        if self.tokenizer is None:
            return None
        before = len(self.text)
        self.text += self._delta(final=False)
        return self._find_stop(before)

    def flush(self) -> None:
        """At the end of the request: emit what the window held back (an incomplete character included)."""
        if self.tokenizer is not None and self._read < len(self.tokens):
            before = len(self.text)
            self.text += self._delta(final=True)
            self._find_stop(before)

    def visible_text(self, final: bool) -> str:
        if final or not self._hold:
            return self.text
        return self.text[: max(len(self.text) - self._hold, 0)]

    def _delta(self, final: bool) -> str:
        assert self.tokenizer is not None
        prefix_text = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        new_text = self.tokenizer.decode(self.tokens[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.tokens)
            return new_text[len(prefix_text) :]
        return ""

    def _find_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        start = max(before - self._hold, 0)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        idx, s = min(found)
        self.text = self.text[:idx]
        return s
