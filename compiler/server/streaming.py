"""Turning engine outputs into OpenAI responses: whole bodies, and server-sent event streams.

Completions' echo puts the prompt's text before a choice's text, and with logprobs its tokens' entries (the first
one null) before the output's, in the body or in the choice's first chunk; with max_tokens 0 (prompt_only) the
response is the prompt alone: the one token the engine samples is not shown, nor counted in usage, and the
finish_reason is "length". vLLM's prompt_logprobs field is on each completions choice, or on the chat response.
With return_token_ids, as vLLM: each choice carries its token_ids, and its prompt's prompt_token_ids (completions: on
the choice, in a stream on its first chunk; chat: on the response, in a stream on the role chunks). With
stream_options continuous_usage_stats (and include_usage), every chunk carries its choice's usage so far, as vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from kiln.runtime.request import RequestOutput
from kiln.server.logprobs import TokenLogprobs, prompt_logprobs_field
from kiln.server.protocol import APIError
from kiln.step import TokenizerLike


class Choices:
    """The choices of one HTTP request (n per prompt), filled from the engine outputs of their request ids."""

    def __init__(self, base_id: str, kind: str, model: str, request_ids: list[str], prompt_tokens: int,
                 return_token_ids: bool = False, *, logprobs: int | None = None,
                 tokenizer: TokenizerLike | None = None, echo: list[str] | None = None, prompt_only: bool = False,
                 prompt_logprobs: int | None = None, prompt_ids: list[list[int]] | None = None,
                 tokens_as_ids: bool = False):
        """echo: per choice, the prompt text to put first (None: no echo); prompt_only: echo with max_tokens 0;
        prompt_logprobs: how many top alternatives vLLM's prompt_logprobs field shows (None: no field); prompt_ids:
        per choice, its prompt's token ids (prompt_token_ids with return_token_ids, continuous usage stats);
        tokens_as_ids: logprobs name tokens "token_id:ID" (vLLM's return_tokens_as_token_ids)."""
        self.id, self.kind, self.model = base_id, kind, model
        self.created = int(time.time())
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.prompt_tokens = prompt_tokens  # each prompt once, however many choices share it
        self.text = [""] * len(request_ids)
        self.num_tokens = [0] * len(request_ids)
        self.finish = [None] * len(request_ids)
        self.stop_reason: list[int | str | None] = [None] * len(request_ids)
        self.role_sent = False  # chat streams: the role chunks, one per choice, went out
        self.token_ids: list[list[int]] = [[] for _ in request_ids]
        self.return_token_ids = return_token_ids
        # logprobs None: not asked; else how many top alternatives each token shows
        self.logprobs = (None if logprobs is None else
                         [TokenLogprobs(tokenizer, logprobs, as_ids=tokens_as_ids) for _ in request_ids])
        self.prompt_ids = prompt_ids if prompt_ids is not None else [[] for _ in request_ids]
        self.prompt_ids_sent = [False] * len(request_ids)  # streams: each choice's first chunk carries them
        self.tokenizer = tokenizer
        self.echo, self.prompt_only, self.shown_prompt = echo, prompt_only, prompt_logprobs
        self.echoed = [False] * len(request_ids)
        # per choice (prompt ids, prompt logprobs), from its first output that has them
        self.prompt: list[tuple | None] = [None] * len(request_ids)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def update(self, item: RequestOutput | Exception) -> tuple[int, str, list[int], str | None, list | None]:
        """Apply one output; (choice index, new text, new token ids, finish reason or None, the new tokens'
        (token id, {token id: Logprob}) or None when not asked). An engine failure, or an APIError the engine loop
        delivered instead of an output, raises."""
        if isinstance(item, APIError):  # the server's own end of the request (the shutdown drain's deadline)
            raise item.again()
        if isinstance(item, Exception):
            raise APIError(500, str(item), code="engine_failure")
        i = self.index[item.request_id]
        comp = item.outputs[0]
        if item.finished and comp.finish_reason == "error":  # not a normal end: the client must not take it as one
            raise APIError(500, f"the request failed while generating: {item.error or 'no reason given'}",
                           code="generation_failed")
        if item.prompt_logprobs is not None and self.prompt[i] is None:  # a delta output carries them once
            self.prompt[i] = (item.prompt_token_ids, item.prompt_logprobs)
        # The server asks for output_kind "delta": each output carries only what is new, added up here.
        text, ids, lps = comp.delta_text, comp.delta_token_ids, comp.delta_logprobs or []
        if self.prompt_only:  # echo with max_tokens 0: the token sampled is not part of the response
            text, ids, lps = "", [], []
        entries_ids: list[int] = list(ids)
        if self.echo is not None and not self.echoed[i]:
            self.echoed[i] = True
            text = self.echo[i] + text
            if self.logprobs is not None and item.prompt_logprobs is not None:  # the engine scored the prompt
                entries_ids, lps = list(item.prompt_token_ids) + entries_ids, list(item.prompt_logprobs) + lps
        self.text[i] += text
        self.token_ids[i] += ids
        self.num_tokens[i] = len(self.token_ids[i])
        if item.finished:
            self.finish[i] = "length" if comp.finish_reason == "length" or self.prompt_only else "stop"
            # vLLM's: a stop string or stop_token_ids id; null for eos (and for the prompt alone)
            self.stop_reason[i] = None if self.prompt_only else comp.stop_reason
        new = None
        if self.logprobs is not None and lps:
            new = self.logprobs[i].add(entries_ids, lps)
        return i, text, ids, self.finish[i], new

    def format_logprobs(self, i: int, entries: list) -> dict:
        """`entries` of choice i in this API's shape (completions: text offsets continue from the last call)."""
        lp = self.logprobs[i]
        return lp.chat(entries) if self.kind == "chat.completion" else lp.completion(entries)

    def whole_logprobs(self, i: int) -> dict | None:
        """Choice i's logprobs over all its tokens (non-streaming bodies), or None when not asked."""
        return None if self.logprobs is None else self.format_logprobs(i, self.logprobs[i].entries)

    def prompt_field(self, i: int) -> list | None:
        """vLLM's prompt_logprobs of choice i's prompt (None when its output had none)."""
        got = self.prompt[i]
        return None if got is None else prompt_logprobs_field(self.tokenizer, *got, self.shown_prompt)

    def usage(self) -> dict[str, int]:
        completion = sum(self.num_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def choice_usage(self, i: int) -> dict[str, int]:
        """Choice i's usage so far (vLLM's continuous_usage_stats): its prompt's tokens and its own."""
        prompt, completion = len(self.prompt_ids[i]), self.num_tokens[i]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False,
              prompt_token_ids: list[int] | None = None) -> str:
        """One event; with_usage (include_usage asked) puts "usage" on every chunk, null but on the last unless
        given (continuous usage stats), as OpenAI and vLLM do; prompt_token_ids: a chat stream's role chunk's."""
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage:
            body["usage"] = usage
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = prompt_token_ids
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def completion_body(c: Choices) -> dict:
    chat = c.kind == "chat.completion"
    if chat:
        choices: list[dict] = [{"index": i, "message": {"role": "assistant", "content": t},
                                "logprobs": c.whole_logprobs(i), "finish_reason": f, "stop_reason": c.stop_reason[i]}
                               for i, (t, f) in enumerate(zip(c.text, c.finish, strict=True))]
    else:
        choices = [{"index": i, "text": t, "logprobs": c.whole_logprobs(i), "finish_reason": f,
                    "stop_reason": c.stop_reason[i]} for i, (t, f) in enumerate(zip(c.text, c.finish, strict=True))]
        if c.shown_prompt is not None:  # per choice, as vLLM's completions (each choice has its prompt)
            for i, choice in enumerate(choices):
                choice["prompt_logprobs"] = c.prompt_field(i)
    if c.return_token_ids:
        for i, (choice, ids) in enumerate(zip(choices, c.token_ids, strict=True)):
            choice["token_ids"] = ids
            if not chat:  # vLLM's completions choice has its prompt's; chat's response has the one prompt's
                choice["prompt_token_ids"] = c.prompt_ids[i]
    body = {"id": c.id, "object": c.kind, "created": c.created, "model": c.model, "choices": choices,
            "usage": c.usage()}
    if chat and c.shown_prompt is not None:  # vLLM's chat response has one, beside the choices
        body["prompt_logprobs"] = c.prompt_field(0)
    if chat and c.return_token_ids:
        body["prompt_token_ids"] = c.prompt_ids[0]
    return body


def _role_choice(c: Choices, i: int) -> dict:
    """Choice i's first chunk in a chat stream, as OpenAI's and vLLM's: the role with empty content, no logprobs (they
    go with the chunk that carries their token's text)."""
    choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
              "stop_reason": None}
    if c.return_token_ids:
        choice["token_ids"] = []
    return choice


async def sse_stream(sink: asyncio.Queue, c: Choices, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
    """One event per choice per step, then (when asked) a usage chunk with no choices, then [DONE]. A chat stream
    opens, when the first output arrives (after the prompt's prefill, as vLLM), with a role chunk per choice; the
    deltas after it carry content only. continuous_usage (with include_usage, as vLLM): every chunk's usage is its
    choice's so far."""
    chat = c.kind == "chat.completion"
    continuous_usage = continuous_usage and include_usage

    def usage_of(i: int, opening: bool = False) -> dict | None:
        """Choice i's usage for its chunk (None: none); a role chunk's counts no completion token yet, as vLLM's."""
        if not continuous_usage:
            return None
        usage = c.choice_usage(i)
        return {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]} if opening else usage

    while not c.done:
        try:
            i, delta, ids, finish, new = c.update(await sink.get())
        except APIError as e:  # the engine failed mid-stream: say so in the stream, as OpenAI does
            yield f"data: {json.dumps(e.body())}\n\n"
            break
        if chat and not c.role_sent:
            c.role_sent = True
            for k in range(len(c.text)):
                yield c.chunk([_role_choice(c, k)], usage_of(k, opening=True), include_usage,
                              prompt_token_ids=c.prompt_ids[k] if c.return_token_ids else None)
        if not delta and finish is None and not (c.return_token_ids and ids) and not new:
            continue  # text held back (a partial UTF-8 character or a possible stop string): nothing to send
        lp = c.format_logprobs(i, new) if new else None
        if chat:
            choice = {"index": i, "delta": {"content": delta}, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta, "logprobs": lp, "finish_reason": finish}
        choice["stop_reason"] = c.stop_reason[i] if finish is not None else None  # null until the last, as vLLM
        if c.return_token_ids:
            choice["token_ids"] = ids
            if not chat:  # vLLM's: the choice's first chunk carries its prompt's ids, later ones null
                choice["prompt_token_ids"] = None if c.prompt_ids_sent[i] else c.prompt_ids[i]
                c.prompt_ids_sent[i] = True
        yield c.chunk([choice], usage_of(i), include_usage)
    if include_usage and c.done:
        yield c.chunk([], c.usage())
    yield "data: [DONE]\n\n"
