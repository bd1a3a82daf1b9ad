"""How a request gets into the engine (runtime/engine.py's Engine is an EngineRequests): add_request takes a prompt as
text or token ids, truncates it as its SamplingParams say, checks it against the model and max_model_len, makes
max_tokens the number this prompt gets (max_tokens_for, kiln.runtime.prompt_limits' rules), each refusal a RequestError
with nothing queued; the request is then made (detokenizer, generator) and queued in the scheduler. The pool always
holds what is accepted: at most max_model_len tokens, and the engine has room for one such sequence (kv_pool.py)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from kiln.errors import RequestError
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.engine_setup import EngineSetup
from kiln.runtime.prompt_limits import resolve_max_tokens, truncate_prompt
from kiln.runtime.request import Request
from kiln.runtime.request_checks import check_params_for_model, check_prompt
from kiln.runtime.sampler import make_generator
from kiln.runtime.sampling_params import SamplingParams

log = logging.getLogger("kiln.runtime")


class EngineRequests(EngineSetup):
    """The engine's request intake (see the module docstring); Engine (runtime/engine.py) adds stepping to it."""

    def add_request(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | dict | None = None,
                    request_id: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                    max_tokens_is_default: bool = False) -> str:
        """Queue one request and return its id. A prompt is text (tokenized here) or token ids: a sequence of
        ints, a 1-D numpy array or a 1-D integer tensor. params: a SamplingParams or a dict of its fields; its
        truncate_prompt_tokens cuts the prompt, max_tokens None becomes what max_model_len leaves after it, and a
        max_tokens past that is cut to it: the request stops at max_model_len with finish_reason "length", as
        vLLM's engine stops it (max_tokens_for). A prompt that leaves no room is refused. max_tokens_is_default:
        params.max_tokens is a default the user never chose (a checkpoint's max_new_tokens); it only words the
        errors."""
        params = SamplingParams.coerce(params, "params").validate()
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt_token_ids = prompt
        if prompt_token_ids is None:
            if text is None:
                raise RequestError("no prompt: give prompt text or prompt_token_ids")
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; give prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(text)
        ids, params = self._check_prompt(prompt_token_ids, params, max_tokens_is_default)
        order = next(self._ids)
        rid = str(order) if request_id is None else str(request_id)
        while request_id is None and rid in self.requests:  # a caller took this number as its own id
            rid = str(next(self._ids))
        if rid in self.requests:
            raise RequestError(f"request_id {rid!r} is already in use by an unfinished request; pick another")
        det = Detokenizer(self.tokenizer, params.stop, self.output.token_text, params.include_stop_str_in_output,
                          params.min_tokens, prompt_token_ids=ids)
        req = Request(rid, text, ids, params, det, make_generator(params.seed, self.model.device), order)
        self.requests[rid] = req
        self.scheduler.add(req)
        if self.drafter is not None and not self._seed_note and params.speculate is None and params.seed is not None \
                and not params.greedy:
            self._seed_note = True  # once per engine: servers see many seeded requests
            log.warning("seeded sampling requests are not speculated (their tokens would depend on the batch); set "
                        "SamplingParams(speculate=True) to speculate them anyway")
        return rid

    def _check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams, max_tokens_is_default: bool
                      ) -> tuple[list[int], SamplingParams]:
        """The prompt's ids, truncated as params say, and the params with max_tokens made the number this prompt
        gets (max_tokens_for), or a RequestError."""
        ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        # Any max_tokens is checked as None is (the prompt must leave room), then cut to the room by max_tokens_for.
        ids = check_prompt(ids, None, vocab=self.model.vocab, limit=self.max_model_len, limit_name=self._limit_name)
        check_params_for_model(params, self.model.vocab)
        max_tokens = self.max_tokens_for(len(ids), params.max_tokens, is_default=max_tokens_is_default)
        if max_tokens != params.max_tokens:  # the pool always holds one max_model_len sequence (choose_num_blocks)
            if params.min_tokens > max_tokens:  # vLLM would run past max_model_len (min_tokens is checked first)
                given = "None" if params.max_tokens is None else \
                    f"{params.max_tokens}{' (a default)' if max_tokens_is_default else ''}"
                raise RequestError(f"sampling parameter min_tokens = {params.min_tokens} is more than the {max_tokens} "
                                   f"tokens the {self._limit_name} leaves after the prompt (max_tokens = {given}); "
                                   f"allowed: min_tokens <= {max_tokens}; lower min_tokens or shorten the prompt",
                                   param="min_tokens")
            params = dataclasses.replace(params, max_tokens=max_tokens)
        # No pool check here: prompt + max_tokens is now at most max_model_len, and choose_num_blocks refused (with
        # PoolTooSmallError) any pool without room for one max_model_len sequence when the engine was made.
        return ids, params

    def max_tokens_for(self, prompt_len: int, max_tokens: int | None, *, is_default: bool = False,
                       cut: bool = True) -> int:
        """How many tokens a request whose prompt has prompt_len tokens (after truncation) generates here:
        kiln.runtime.prompt_limits.resolve_max_tokens against max_model_len (None: the rest of the context; any
        value: at most that). add_request applies it; the server asks it first with cut=False (a max_tokens the
        client sent past the context is a RequestError, as vLLM's server refuses it), for its 400s. Reads only fixed
        settings, so any thread may call it."""
        return resolve_max_tokens(max_tokens, prompt_len, self.max_model_len, is_default=is_default, cut=cut,
                                  limit_name=self._limit_name)

    @property
    def _limit_name(self) -> str:
        """How errors name max_model_len."""
        return "model context" if self.max_model_len == self.cfg.context else "engine's max_model_len"
