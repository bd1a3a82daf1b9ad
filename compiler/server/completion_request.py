"""/v1/completions' request model, CompletionRequest: its prompt forms (one or a batch, text or token ids), echo,
logprobs and best_of."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from kiln.server.errors import APIError
from kiln.server.request_base import MAX_PROMPTS, _Sampling


class CompletionRequest(_Sampling):
    # vLLM's (and OpenAI's legacy API's) max_tokens: 16 when omitted, checked as if sent; an explicit null is no limit
    # (the model's default max_tokens cut to the context, else the rest of the context), as vLLM's get_max_tokens
    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    max_tokens: int | None = 16

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # the prompt before the text; with logprobs, its tokens' logprobs before the output's
    suffix: str | None = None
    # OpenAI's: sample best_of and return the n most likely; kiln returns what it samples, so only best_of == n
    best_of: int | None = Field(default=None, ge=1)
    # vLLM extension: a text prompt gets the special tokens the tokenizer adds (Llama's BOS), as vLLM's default
    add_special_tokens: bool = True

    def check_fields(self) -> None:
        super().check_fields()
        if self.suffix:
            raise APIError(400, "suffix is not supported; omit suffix", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of = {self.best_of} is less than n = {self.n}; allowed: best_of >= n (the "
                           "choices returned come from the ones sampled)", param="best_of", code="invalid_value")
        if self.best_of is not None and self.best_of > self.n:
            raise APIError(400, f"kiln does not support best_of > n (best_of = {self.best_of}, n = {self.n}): it "
                           "returns every choice it samples and does not rank them; omit best_of, or ask for n = "
                           f"{self.best_of} choices and pick among them", param="best_of",
                           code="unsupported_parameter")
        if isinstance(self.prompt, list) and len(self.prompt) > MAX_PROMPTS and not isinstance(self.prompt[0], int):
            raise APIError(400, f"prompt is a list of {len(self.prompt)} prompts, over the limit of {MAX_PROMPTS} in "
                           "one request (vLLM's VLLM_MAX_COMPLETION_PROMPTS default); split it over several requests",
                           param="prompt", code="invalid_value")
        # max_tokens 0 is OpenAI's legacy API's (and vLLM's) with echo: the prompt alone, with its logprobs
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens = 0 generates nothing; it is allowed only with echo: true (the prompt "
                           "alone, with its logprobs when logprobs is set); give max_tokens >= 1",
                           param="max_tokens", code="invalid_value")

    def requested_max_tokens(self) -> int | None:
        """echo with max_tokens 0 runs the engine for one token (not shown), as vLLM does."""
        return 1 if self.prompt_only else self.max_tokens

    def limit_given(self) -> bool:
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None

    def unset_limit(self, max_tokens: int) -> tuple[str, str]:
        if "max_tokens" in self.model_fields_set:  # an explicit null: no limit but the context
            return "max_tokens", f"the {max_tokens} tokens the context leaves after the prompt (max_tokens null)"
        return super().unset_limit(max_tokens)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the response is the prompt alone (the engine samples one token, not shown)."""
        return self.echo and self.max_tokens == 0

    def shown_prompt_logprobs(self) -> int | None:
        """As vLLM's: the field is there too when echo with logprobs scored the prompt (showing that many)."""
        if self.stream or self.prompt_logprobs is not None:
            return super().shown_prompt_logprobs()
        return self.logprobs if self.echo else None

    def engine_prompt_logprobs(self) -> int | None:
        """As vLLM: prompt_logprobs, or with echo the logprobs count, whichever shows more."""
        counts = [c for c in (self.shown_prompt_logprobs(), self.logprobs if self.echo else None) if c is not None]
        return max(counts) if counts else None

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch: text, token ids, a list of texts or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; give text or at least one token id", param="prompt")
        return list(p)

    def engine_logprobs(self) -> int | None:
        return self.logprobs
