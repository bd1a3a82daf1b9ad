"""Incremental detokenization and stop strings for one request.

Decoding every output token alone breaks multi-byte characters and the leading-space rules of BPE and
sentencepiece vocabularies, so (as TGI and vLLM do) we decode a small window twice: the tokens last turned
into text (the context) and the same window plus the pending tokens; the difference is the new text. A window
that ends in U+FFFD is an incomplete character, and we wait for more tokens. Pending tokens that add no text at
all (special tokens, or the ids above 255 of kiln's byte-level fallback, which a random-weight model emits
constantly) are dropped from the window, and an incomplete character is waited for over MAX_PENDING tokens at
most, so each token costs two decodes of a few tokens, not of everything since the last visible character.

The first window starts with the prompt's last PROMPT_CONTEXT tokens (as vLLM seeds its incremental decoder), so
the output's text is decode(prompt + output) less decode(prompt): a sentencepiece word's leading space, which a
decode dropped at the start of the text, stays, and a character whose first bytes end the prompt comes out whole
as the output's first character (decode(prompt) has U+FFFD in its place) instead of as U+FFFD.

Stop strings are searched only in the tail that a new delta can complete. While a request runs, the last
len(longest stop) - 1 characters are held back from streamed text, so text that a stop string later trims
is never sent.

vLLM's skip_special_tokens (configure): by default special tokens add no text, as the tokenizer's decode skips them;
False decodes every window keeping them (and stop strings see their text). spaces_between_special_tokens False (with
skip_special_tokens False) gives an added token that follows another one its own text, without the spaces the
tokenizer's decoder puts before it, as vLLM's fast detokenizer does.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence

from kiln.step import TokenizerLike

log = logging.getLogger("kiln.runtime")

MAX_PENDING = 8  # tokens an incomplete character may wait for before its replacement character is emitted
# Prompt tokens the first window starts with: a character's first 3 bytes, the token before them (the space rule)
# and 2 more for special tokens, which decode to nothing (vLLM's window is about as long).
PROMPT_CONTEXT = 6


class Detokenizer:
    def __init__(self, tokenizer: TokenizerLike | None, stop: Sequence[str] = (),
                 token_text: dict[int, str] | None = None, include_stop: bool = False, min_tokens: int = 0,
                 prompt_token_ids: Sequence[int] = ()):
        """token_text: a cache of decode([id]) that detokenizers of one tokenizer share (the engine's), filled as
        they go: a one-token context, what most windows start from, is then decoded once per id, not per use.
        include_stop: a stop string found stays at the end of the text (else the text ends before it).
        min_tokens: stop strings are searched only from the token after the min_tokens-th on (vLLM's rule, the
        one eos follows too: it can be sampled once min_tokens tokens are out), in the text that token completes.
        prompt_token_ids: the request's prompt; its last PROMPT_CONTEXT ids are the first window's context (their
        text is not the output's: stop strings are never searched in it)."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._token_text = self._shared_text = token_text
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        # The tokens whose text was emitted last: context for the next delta. At first the prompt's last ones, whose
        # text is not the output's (_from_prompt), and the 3 before them (_before), for a tail that starts inside a
        # character (see _prompt_text).
        self._context: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._before: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT - 3 : -PROMPT_CONTEXT])
        self._from_prompt = bool(self._context)
        self._context_text: str | None = None  # their text alone (decoded once, when first needed)
        self._pending: list[int] = []  # tokens whose text is not emitted yet (an incomplete character)
        self._verbatim: Callable[[list[int]], str] | None = None  # skip_special_tokens False: decode keeping them
        self.skip_special_tokens = True
        self._added: dict[int, str] | None = None  # spaces_between_special_tokens False: added tokens' own text
        self._last_added = False

    def configure(self, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        """vLLM's detokenizer options (SamplingParams'), set before the first token: skip_special_tokens False
        keeps special tokens' text; spaces_between_special_tokens False then leaves out the spaces the tokenizer
        puts between two added tokens. Request sets them from its params."""
        if skip_special_tokens and self.skip_special_tokens:
            return  # the defaults, as built (every request passes here)
        assert not self.tokens, "configure() a detokenizer before its first token"
        self.skip_special_tokens = skip_special_tokens
        if self.tokenizer is None:
            return
        self._verbatim = None if skip_special_tokens else verbatim_decoder(self.tokenizer)
        # decode([id]) differs for special tokens without skipping: the engine's shared cache has a second table
        self._token_text = self._shared_text if skip_special_tokens else getattr(self._shared_text, "verbatim", None)
        self._added = None if skip_special_tokens or spaces_between_special_tokens else added_tokens(self.tokenizer)
        self._context_text = None

    def add(self, token_id: int) -> str | None:
        """Add one generated token; return the stop string it completed (the text is trimmed there), else None."""
        self.tokens.append(token_id)
        if self.tokenizer is None:
            return None
        self._pending.append(token_id)
        before = len(self.text)
        delta = self._delta(final=False)
        if self._added is not None:
            delta = self._between_added(token_id, delta)
        self.text += delta
        return self._find_stop(before) if self.stop and len(self.tokens) > self.min_tokens else None

    def _between_added(self, token_id: int, delta: str) -> str:
        """An added token right after another one: its own text, without the spaces the decoder put before it."""
        own = self._added.get(token_id)  # type: ignore[union-attr]
        after_added, self._last_added = self._last_added, own is not None
        if own is not None and after_added and delta.endswith(own) and not delta[: -len(own)].strip():
            return own
        return delta

    def flush(self) -> None:
        """At the end of the request: emit what the window held back (an incomplete character included)."""
        if self.tokenizer is not None and self._pending:
            before = len(self.text)
            self.text += self._delta(final=True)
            if len(self.tokens) > self.min_tokens:
                self._find_stop(before)

    def token_str(self, token_id: int) -> str | None:
        """One token's text alone, decode([id]) as vLLM's Logprob.decoded_token (None without a tokenizer), from the
        engine's shared cache."""
        if self.tokenizer is None:
            return None
        cache = self._token_text
        text = cache.get(token_id) if cache is not None else None
        if text is None:
            try:  # an alternative the request never produced must not fail it (a slow tokenizer raises on some ids)
                text = self._dec([token_id])
            except Exception as e:
                _log_undecodable(self.tokenizer, token_id, e)
                return None
            if cache is not None:
                cache[token_id] = text
        return text

    def visible_text(self, final: bool) -> str:
        if final or not self._hold:
            return self.text
        return self.text[: max(len(self.text) - self._hold, 0)]

    def _dec(self, ids: list[int]) -> str:
        verbatim = self._verbatim
        return verbatim(ids) if verbatim is not None else self.tokenizer.decode(ids)  # type: ignore[union-attr]

    def _delta(self, final: bool) -> str:
        assert self.tokenizer is not None
        if self._context_text is None:
            cache = self._token_text
            if self._from_prompt:
                self._context_text = self._prompt_text()
            elif cache is not None and len(self._context) == 1:
                tok = self._context[0]
                text = cache.get(tok)
                if text is None:
                    text = cache[tok] = self._dec(self._context)
                self._context_text = text
            else:
                self._context_text = self._dec(self._context)
        prefix_text = self._context_text
        new_text = self._dec(self._context + self._pending)
        # A character is at most 4 bytes (4 byte tokens): pending longer than MAX_PENDING is not a character that
        # is still coming but broken text (or bytes interleaved with tokens that have none), emitted as it is.
        complete = final or not new_text.endswith("\ufffd") or len(self._pending) > MAX_PENDING
        start = len(prefix_text)
        if self._from_prompt and not new_text.startswith(prefix_text):
            start = _output_start(prefix_text, new_text)
        if len(new_text) > start and complete:
            if self._from_prompt and prefix_text.endswith("\ufffd"):
                # The prompt's last bytes (a character the output completed, or broken ones) stay in the window: alone,
                # the output's first bytes would decode as broken ones (byte fallback breaks a whole run of bytes).
                self._context, self._context_text = self._context + self._pending, new_text
            else:
                self._context, self._context_text = self._pending, None
            self._pending, self._from_prompt = [], False
            return new_text[start:]
        # The prompt's text may end in an incomplete character whose next bytes leave the text as it is (one U+FFFD
        # for a truncated sequence): those tokens are kept, up to MAX_PENDING, for the bytes that complete it.
        waiting = self._from_prompt and prefix_text.endswith("\ufffd") and len(self._pending) <= MAX_PENDING
        if new_text == prefix_text and not waiting:  # the pending tokens add nothing here: drop them from the window
            self._pending = []
        return ""

    def _prompt_text(self) -> str:
        """The text of the prompt's tail, the tail moved back (3 tokens at most) while it starts inside a character:
        byte fallback decodes a whole run of byte tokens as U+FFFD when one of them is broken, the output's too."""
        assert self.tokenizer is not None
        text = self._dec(self._context)
        while text.startswith("\ufffd") and self._before:
            self._context.insert(0, self._before.pop())
            text = self._dec(self._context)
        self._before = []
        return text

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


def _output_start(prefix: str, new: str) -> int:
    """Where the output's text starts in `new` (the prompt's tail and the output decoded) when `new` does not
    extend `prefix` (the tail alone): after the prompt's text up to its trailing U+FFFD (an incomplete character)
    and those of them `new` still has (bytes the output did not complete); the character the output completed is
    the output's. A decoder that rewrites earlier text otherwise: after len(prefix), as for every later window."""
    stable = prefix.rstrip("\ufffd")
    if len(stable) == len(prefix) or not new.startswith(stable):
        return len(prefix)
    i = len(stable)
    while i < len(prefix) and i < len(new) and new[i] == prefix[i]:
        i += 1
    return i


def verbatim_decoder(tokenizer: TokenizerLike) -> Callable[[list[int]], str]:
    """decode(ids) keeping special tokens' text: the tokenizer's decode(ids, skip_special_tokens=False) when it takes
    that argument (kiln's tokenizers all do), else its plain decode (a tokenizer that cannot be asked)."""
    decode = tokenizer.decode
    try:
        params = inspect.signature(decode).parameters
    except (TypeError, ValueError):
        params = {}
    if "skip_special_tokens" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda ids: decode(ids, skip_special_tokens=False)  # type: ignore[call-arg]
    return decode


def added_tokens(tokenizer: TokenizerLike) -> dict[int, str]:
    """The tokenizer's added tokens (special ones included) by id, with their text: its added_tokens() (kiln's
    HFTokenizer and GGUFTokenizer); {} when it has none."""
    own = getattr(tokenizer, "added_tokens", None)
    return dict(own()) if callable(own) else {}


class TokenTextCache(dict):
    """decode([id]) by id, shared by the detokenizers of one tokenizer (the engine's), and `verbatim`, the same
    keeping special tokens' text, for the requests with skip_special_tokens False."""

    def __init__(self) -> None:
        super().__init__()
        self.verbatim: dict[int, str] = {}


_undecodable: set[tuple[type, type]] = set()  # the (tokenizer type, exception type) pairs token_str has logged


def _log_undecodable(tokenizer: TokenizerLike, token_id: int, e: Exception) -> None:
    """token_str's decode failed: logged with its traceback (a tokenizer bug would otherwise pass unseen), once per
    tokenizer type and exception type (a slow tokenizer that raises on every id past its vocabulary would flood the
    log)."""
    key = (type(tokenizer), type(e))
    if key in _undecodable:
        return
    _undecodable.add(key)
    log.warning("decoding token id %d alone failed (%s: %s); its decoded_token is None (logged once for %s)",
                token_id, type(e).__name__, e, type(tokenizer).__name__, exc_info=e)
