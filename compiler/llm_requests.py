"""LLM's engine requests: a call's prompts added to the engine (all or nothing), each request's outputs routed to
its own queue (whoever steps the engine fills everyone's), and with SamplingParams(n=k) a prompt's k choices merged
back under one request_id (_Prompt, _merge_metrics)."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kiln.errors import KilnError, RequestError
from kiln.llm_prompts import _text_prompts, _token_prompts
from kiln.runtime.request import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import encode_text


class LLMRequests:
    """The request side of kiln.llm.LLM, which sets what it uses: engine, loaded, get_default_sampling_params(),
    _queues (request id -> its outputs not yet taken) and _lock (an RLock over the engine and the queues)."""

    def _merged(self, groups: list[_Prompt]) -> Iterator[RequestOutput]:
        """_drain's outputs as the caller sees them: a prompt with one choice as the engine made them, one with n
        choices under its request_id, each choice's CompletionOutput indexed (see generate_stream)."""
        owner = {rid: (g, i) for g in groups for i, rid in enumerate(g.rids)}
        for out in self._drain(list(owner)):
            g, i = owner[out.request_id]
            if len(g.rids) == 1:
                yield out
                continue
            comp = dataclasses.replace(out.outputs[0], index=i)
            if g.final_only:
                g.latest[i] = comp
            if out.finished:
                g.metrics[i] = out.metrics
                if out.error is not None:
                    g.errors[i] = f"choice {i}: {out.error}"
            done = len(g.metrics) == len(g.rids)
            if g.final_only and not done:
                continue
            comps = [g.latest[j] for j in range(len(g.rids))] if g.final_only else [comp]
            errors = "; ".join(g.errors[j] for j in sorted(g.errors)) or None  # the failed choices' so far
            yield RequestOutput(g.request_id, out.prompt, out.prompt_token_ids, comps, done,
                                _merge_metrics([g.metrics[j] for j in sorted(g.metrics)], out.metrics) if done
                                else out.metrics, errors, g.prompt_logprobs(out))

    def _drain(self, ids: list[str]) -> Iterator[RequestOutput]:
        """This caller's outputs: what is queued first, and a step of the engine whenever nothing is."""
        left = list(ids)
        while left:
            ready: list[RequestOutput] = []
            with self._lock:
                for rid in left:
                    ready += self._queues[rid]
                    self._queues[rid].clear()
                if not ready:
                    if not self.engine.has_unfinished():
                        raise KilnError(f"requests {left} left the engine without a final output (aborted through "
                                        "LLM.engine directly?); abort them through the LLM's generators instead")
                    self._route(self.engine.step())
            for out in ready:  # yielded outside the lock: the consumer may run other streams meanwhile
                if out.finished:
                    left.remove(out.request_id)
                yield out

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:  # requests added through LLM.engine directly are not ours to keep
                q.append(out)

    def _release(self, groups: list[_Prompt]) -> None:
        with self._lock:
            for g in groups:
                for rid in g.rids:
                    self.engine.abort(rid, notify=False)  # no-op for the finished ones
                    self._queues.pop(rid, None)

    def _add(self, prompts, sampling_params, prompt_token_ids, output_kind: str | None = None,
             add_special: bool = True) -> list[_Prompt]:
        """The call's prompts added to the engine, all or nothing. add_special: a text prompt gets the special tokens
        the tokenizer adds (generate; chat's rendered prompts get none, see _encoded)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts (text) and prompt_token_ids")
        if prompts is not None:
            items = _text_prompts(prompts)
        else:
            items = [("ids", p) for p in _token_prompts(prompt_token_ids)]
        # The engine cuts any max_tokens to what max_model_len leaves after the prompt (vLLM's engine stops a request
        # there); is_default (a checkpoint's max_new_tokens, which the user never chose) only words its errors.
        is_default = sampling_params is None and "max_tokens" in self.loaded.generation_defaults
        if sampling_params is None:  # as vLLM: the model's generation_config.json defaults, unless "vllm"
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, dict)):
            params = [SamplingParams.coerce(sampling_params)] * len(items)
        elif isinstance(sampling_params, (list, tuple)):
            params = [SamplingParams.coerce(p, f"sampling_params[{i}]") for i, p in enumerate(sampling_params)]
            if len(params) != len(items):
                raise RequestError(f"sampling_params has {len(params)} entries for {len(items)} prompts; give one "
                                   "SamplingParams or one per prompt")
        else:
            raise RequestError(f"sampling_params must be a SamplingParams, a dict of its fields or a list of those "
                               f"(one per prompt), not {type(sampling_params).__name__}")
        groups: list[_Prompt] = []
        with self._lock:
            try:
                for i, ((kind, item), p) in enumerate(zip(items, params, strict=True)):
                    try:
                        if output_kind is not None and p.output_kind != output_kind:
                            p = dataclasses.replace(p.validate(), output_kind=output_kind)  # a bad kind is named
                        group = _Prompt([], p.output_kind == "final_only", p.output_kind == "delta")
                        groups.append(group)
                        choices = p.choices()  # validated: a bad value is named before anything is encoded
                        text, ids = self._encoded(kind, item, add_special)
                        for choice in choices:  # n > 1: one engine request per choice
                            # ids None: text without a tokenizer, which the engine refuses saying why; the engine
                            # applies truncate_prompt_tokens and cuts max_tokens to the context
                            rid = self.engine.add_request(text, choice, prompt_token_ids=ids,
                                                          max_tokens_is_default=is_default)
                            self._queues[rid] = deque()
                            group.rids.append(rid)
                    except RequestError as e:
                        if len(items) == 1:
                            raise
                        raise RequestError(f"prompt {i}: {e}", param=e.param, code=e.code) from None
            except BaseException:
                self._release(groups)  # all or nothing: a bad prompt leaves no half-submitted batch behind
                raise
        return groups

    def _encoded(self, kind: str, item: object, add_special: bool) -> tuple[str | None, Sequence[int] | None]:
        """A prompt's text (None for ids) and the ids the engine gets: a text encoded once, here, with or without
        (add_special False: LLM.chat's rendered prompt, as vLLM's LLM.chat and the server's chat encode it) the
        special tokens the tokenizer adds, None without a tokenizer."""
        if kind != "text":
            return None, item  # type: ignore[return-value]
        if self.engine.tokenizer is None:
            return item, None  # type: ignore[return-value]
        return item, encode_text(self.engine.tokenizer, item, add_special)  # type: ignore[arg-type,return-value]


@dataclass
class _Prompt:
    """One prompt of a generate / generate_stream call: its engine requests, one per choice (SamplingParams.n),
    and, with n > 1, what _merged keeps of them: each choice's final output (final_only), and its metrics and error
    once finished."""

    rids: list[str]
    final_only: bool
    delta: bool
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    metrics: dict[int, RequestMetrics] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    prompt: list | None = None  # prompt_logprobs, from the first choice output with them
    prompt_given: bool = False

    @property
    def request_id(self) -> str:
        return self.rids[0]

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        """What a merged output carries of the prompt's logprobs (every choice scores the same prompt): like one
        request's outputs, on every output once known, or once for "delta" ones."""
        if self.prompt is None and out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs
        if self.prompt is None or (self.delta and self.prompt_given):
            return None
        self.prompt_given = True
        return self.prompt


def _merge_metrics(ms: list[RequestMetrics], last: RequestMetrics) -> RequestMetrics:
    """One prompt's metrics over its choices: from the first arrival to the last finish, the first token of any
    choice (as vLLM reports a request with n > 1), the work counts summed. num_cached_tokens counts the prompt's
    tokens, not work: the last choice to finish (`last`) gives it, as vLLM's output of a request with n > 1 is made
    by its last child to finish, with that child's count (a sum could pass the prompt's length)."""
    def first(name: str) -> float | None:
        vals = [getattr(m, name) for m in ms if getattr(m, name) is not None]
        return min(vals) if vals else None

    finishes = [m.finish_time for m in ms if m.finish_time is not None]
    return RequestMetrics(min(m.arrival_time for m in ms), first_scheduled_time=first("first_scheduled_time"),
                          first_token_time=first("first_token_time"), finish_time=max(finishes) if finishes else None,
                          num_preemptions=sum(m.num_preemptions for m in ms),
                          num_cached_tokens=last.num_cached_tokens,
                          num_draft_tokens=sum(m.num_draft_tokens for m in ms),
                          num_accepted_tokens=sum(m.num_accepted_tokens for m in ms))
