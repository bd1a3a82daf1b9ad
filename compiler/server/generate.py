"""A request's run on the engine: its engine requests (prompts x n) checked and added in one go, and its answer,
streamed or collected; however the response ends (done, client gone, cancelled), its requests are aborted.

build_app binds generate to its engine loop, engine, config, served name and sampling defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.server.config import ServerConfig
from kiln.server.engine_loop import EngineLoop
from kiln.server.protocol import APIError, ChatCompletionRequest, request_error
from kiln.server.streaming import Choices, completion_body, sse_stream

log = logging.getLogger("kiln.server")
_GONE = object()  # put in a non-streaming request's sink when its client disconnects


async def generate(loop: EngineLoop, engine: Engine, config: ServerConfig, served: str, defaults: dict,
                   request: Request, req, prompts: list[list[int]], kind: str, default_max: int | None,
                   echo: list[str] | None = None):
    if not loop.alive:
        raise APIError(503, "the engine loop has stopped (see the server log); restart `kiln serve`",
                       code="engine_stopped")
    jobs = []  # (request id, prompt ids, params)
    chat = kind == "chat.completion"
    default_cap = defaults.get("max_tokens")  # generation_config.json's max_new_tokens: the default, not a cap
    if default_cap is not None:
        default_max = None
    prefix = "chatcmpl" if chat else "cmpl"
    base = f"{prefix}-{uuid.uuid4().hex}"  # the engine's request ids: unique, whatever the client sends
    # The response's id: vLLM's, from X-Request-Id or the request_id field when the client gives one
    given = request.headers.get("x-request-id") or req.request_id
    response_id = f"{prefix}-{given}" if given else base
    for p, ids in enumerate(prompts):
        room = engine.max_model_len - len(ids)
        if req.max_tokens is None and default_max is None and room < 1:
            raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, and "
                           f"your request has {len(ids)} input tokens, which leaves no room for the completion; "
                           "reduce the length of the messages", param="messages",
                           code="context_length_exceeded")
        if req.max_tokens == 0:  # completions' echo of the prompt alone: one token sampled, not shown (as vLLM)
            max_tokens = 1
            if room < 1:  # the engine would blame a max_tokens of 1 the client never sent
                raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, and "
                               f"your prompt has {len(ids)}: echo with max_tokens 0 still computes one token "
                               "after the prompt, so the prompt must leave room for it; shorten the prompt by "
                               "one token", param="prompt", code="context_length_exceeded")
        else:
            max_tokens = req.max_tokens or (default_max if default_max is not None else room)
            if req.max_tokens is None and default_cap is not None:  # vLLM's: the model's default, in the room
                max_tokens = min(default_cap, room)
        _check_min_tokens(req, 0 if req.max_tokens == 0 else max_tokens, chat)
        try:
            choices = req.sampling_params(max_tokens, defaults).choices()  # validated; n > 1: the seed rule there
        except RequestError as e:
            raise request_error(e, _chat_param(e.param, req) if chat else None) from None
        for i, params in enumerate(choices):
            jobs.append((f"{base}-{p * req.n + i}", ids, params))
    if config.max_waiting is not None and len(jobs) > config.max_waiting:
        # all of a request's choices enter the queue together: more than it holds would never be admitted
        raise APIError(400, f"{len(jobs)} completions (prompts x n) in one request, over the "
                       f"{config.max_waiting} requests the server's queue holds (--max-waiting), so it could "
                       "never be admitted; send fewer prompts or a smaller n", param="n")
    waiting = loop.num_waiting
    if config.max_waiting is not None and waiting + len(jobs) > config.max_waiting:
        raise APIError(503, f"server busy: {waiting} requests waiting, the queue "
                       f"holds {config.max_waiting} (--max-waiting); retry after a second",
                       code="queue_full", headers={"Retry-After": "1"})
    sink: asyncio.Queue = asyncio.Queue()
    rids = [j[0] for j in jobs]
    try:
        await loop.add(jobs, sink)  # all at once: every choice starts in the same engine step
    except RequestError as e:  # none of them was added
        raise request_error(e, _chat_param(e.param, req) if chat else None) from None
    except BaseException:
        loop.abort(rids)  # cancelled (client gone) while adding: one of them may be queued already
        raise
    choices = Choices(response_id, kind, served, rids, sum(len(p) for p in prompts),
                      req.return_token_ids, logprobs=req.engine_logprobs(), tokenizer=engine.tokenizer,
                      echo=None if echo is None else [t for t in echo for _ in range(req.n)],
                      prompt_only=getattr(req, "prompt_only", False),
                      prompt_logprobs=req.shown_prompt_logprobs(),
                      prompt_ids=[ids for ids in prompts for _ in range(req.n)],
                      tokens_as_ids=req.return_tokens_as_token_ids)
    if req.stream:
        opts = req.stream_options
        usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        return _AbortingStream(sse_stream(sink, choices, usage, continuous), lambda: loop.abort(rids),
                               media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        await _collect(request, sink, choices)  # returns early when the client disconnects
    finally:
        loop.abort(rids)  # a no-op once they finished; frees their KV blocks when the client left early
    return JSONResponse(completion_body(choices))


def _check_min_tokens(req, max_tokens: int, chat: bool) -> None:
    """A 400 when min_tokens is over the completion's limit, naming the field that set it as the client sent it."""
    if req.min_tokens <= max_tokens:
        return
    name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    if req.max_tokens is not None:  # chat's max_completion_tokens was copied into max_tokens
        limit = f"{name} = {max_tokens}"
    elif chat:
        name = "max_completion_tokens"
        limit = f"the {max_tokens} tokens the context leaves after the messages (no {name} given)"
    else:
        limit = f"max_tokens = {max_tokens} (the default; set max_tokens)"
    raise APIError(400, f"min_tokens = {req.min_tokens} is more than {limit}; allowed: min_tokens <= {name}",
                   param="min_tokens", code="invalid_value")


def _chat_param(param: str | None, req: ChatCompletionRequest) -> str | None:
    """A RequestError's parameter as a chat request names it."""
    if param == "prompt":  # chat has no prompt: it was made from the messages
        return "messages"
    if param == "max_tokens" and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return param


async def _collect(request: Request, sink: asyncio.Queue, choices: Choices) -> None:
    """Fill `choices` from the sink until every one finished, or the client went away.

    The body has been read, so the next ASGI message is http.disconnect: a task waits for it and wakes the loop
    below through the sink at once (no polling; and Request.is_disconnected() never sees the disconnect behind a
    middleware that wraps `receive`, such as Starlette's BaseHTTPMiddleware)."""
    watcher = asyncio.create_task(_watch_disconnect(request, sink))
    try:
        while not choices.done:
            item = await sink.get()
            if item is _GONE:
                return
            choices.update(item)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _watch_disconnect(request: Request, sink: asyncio.Queue) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # a body chunk after the end (none is expected): keep waiting
    except Exception as e:  # the connection is in no state to take the response: stop generating for it
        log.warning("reading from the client failed (%s: %s); aborting its request", type(e).__name__, e)
    sink.put_nowait(_GONE)


class _AbortingStream(StreamingResponse):
    """A streaming response that aborts its requests however it ends (done, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
