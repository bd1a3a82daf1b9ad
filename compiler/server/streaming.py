"""Turning engine outputs into OpenAI responses: whole bodies, and server-sent event streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from kiln.runtime.request import RequestOutput
from kiln.server.logprobs import TokenLogprobs
from kiln.server.protocol import APIError
from kiln.step import TokenizerLike


class Choices:
    """The choices of one HTTP request (n per prompt), filled from the engine outputs of their request ids."""

    def __init__(self, base_id: str, kind: str, model: str, request_ids: list[str], prompt_tokens: int,
                 return_token_ids: bool = False, *, logprobs: int | None = None,
                 tokenizer: TokenizerLike | None = None):
        self.id, self.kind, self.model = base_id, kind, model
        self.created = int(time.time())
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.prompt_tokens = prompt_tokens  # each prompt once, however many choices share it
        self.text = [""] * len(request_ids)
        self.num_tokens = [0] * len(request_ids)
        self.finish = [None] * len(request_ids)
        self.stop_reason: list[int | str | None] = [None] * len(request_ids)
        self.started = [False] * len(request_ids)
        self.token_ids: list[list[int]] = [[] for _ in request_ids]
        self.return_token_ids = return_token_ids
        # logprobs None: not asked; else how many top alternatives each token shows
        self.logprobs = None if logprobs is None else [TokenLogprobs(tokenizer, logprobs) for _ in request_ids]

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def update(self, item: RequestOutput | Exception) -> tuple[int, str, list[int], str | None, list | None]:
        """Apply one output; (choice index, new text, new token ids, finish reason or None, the new tokens'
        (token id, {token id: logprob}) or None when not asked). An engine failure raises."""
        if isinstance(item, Exception):
            raise APIError(500, str(item), code="engine_failure")
        i = self.index[item.request_id]
        comp = item.outputs[0]
        # The server asks for output_kind "delta": each output carries only what is new, added up here.
        self.text[i] += comp.delta_text
        self.token_ids[i] += comp.delta_token_ids
        self.num_tokens[i] = len(self.token_ids[i])
        if item.finished and comp.finish_reason == "error":  # not a normal end: the client must not take it as one
            raise APIError(500, f"the request failed while generating: {item.error or 'no reason given'}",
                           code="generation_failed")
        if item.finished:
            self.finish[i] = "length" if comp.finish_reason == "length" else "stop"
            self.stop_reason[i] = comp.stop_reason  # vLLM's: a stop string or stop_token_ids id; null for eos
        new = None
        if self.logprobs is not None and comp.delta_logprobs:
            new = self.logprobs[i].add(comp.delta_token_ids, comp.delta_logprobs)
        return i, comp.delta_text, comp.delta_token_ids, self.finish[i], new

    def format_logprobs(self, i: int, entries: list) -> dict:
        """`entries` of choice i in this API's shape (completions: text offsets continue from the last call)."""
        lp = self.logprobs[i]
        return lp.chat(entries) if self.kind == "chat.completion" else lp.completion(entries)

    def whole_logprobs(self, i: int) -> dict | None:
        """Choice i's logprobs over all its tokens (non-streaming bodies), or None when not asked."""
        return None if self.logprobs is None else self.format_logprobs(i, self.logprobs[i].entries)

    def usage(self) -> dict[str, int]:
        completion = sum(self.num_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> str:
        """One event; with_usage (include_usage asked) puts "usage" on every chunk, null but on the last, as OpenAI
        and vLLM do."""
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def completion_body(c: Choices) -> dict:
    if c.kind == "chat.completion":
        choices: list[dict] = [{"index": i, "message": {"role": "assistant", "content": t},
                                "logprobs": c.whole_logprobs(i), "finish_reason": f, "stop_reason": c.stop_reason[i]}
                               for i, (t, f) in enumerate(zip(c.text, c.finish, strict=True))]
    else:
        choices = [{"index": i, "text": t, "logprobs": c.whole_logprobs(i), "finish_reason": f,
                    "stop_reason": c.stop_reason[i]} for i, (t, f) in enumerate(zip(c.text, c.finish, strict=True))]
    if c.return_token_ids:
        for choice, ids in zip(choices, c.token_ids, strict=True):
            choice["token_ids"] = ids
    return {"id": c.id, "object": c.kind, "created": c.created, "model": c.model, "choices": choices,
            "usage": c.usage()}


async def sse_stream(sink: asyncio.Queue, c: Choices, include_usage: bool) -> AsyncIterator[str]:
    """One event per choice per step, then (when asked) a usage chunk with no choices, then [DONE]."""
    chat = c.kind == "chat.completion"
    while not c.done:
        try:
            i, delta, ids, finish, new = c.update(await sink.get())
        except APIError as e:  # the engine failed mid-stream: say so in the stream, as OpenAI does
            yield f"data: {json.dumps(e.body())}\n\n"
            break
        if not delta and finish is None and (c.started[i] or not chat) and not (c.return_token_ids and ids) \
                and not new:
            continue  # text held back (a partial UTF-8 character or a possible stop string): nothing to send
        lp = c.format_logprobs(i, new) if new else None
        if chat:
            d = {"content": delta}
            if not c.started[i]:
                d = {"role": "assistant", **d}
                c.started[i] = True
            choice = {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta, "logprobs": lp, "finish_reason": finish}
        choice["stop_reason"] = c.stop_reason[i] if finish is not None else None  # null until the last, as vLLM
        if c.return_token_ids:
            choice["token_ids"] = ids
        yield c.chunk([choice], None, include_usage)
    if include_usage and c.done:
        yield c.chunk([], c.usage())
    yield "data: [DONE]\n\n"
