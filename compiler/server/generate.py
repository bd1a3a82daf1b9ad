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
from kiln.runtime.request_checks import check_params_for_model
from kiln.server.config import ServerConfig
from kiln.server.engine_loop import EngineLoop
from kiln.server.protocol import APIError, request_error
from kiln.server.streaming import Choices, completion_body, sse_stream

log = logging.getLogger("kiln.server")
_GONE = object()  # put in a non-streaming request's sink when its client disconnects


async def generate(loop: EngineLoop, engine: Engine, config: ServerConfig, served: str, defaults: dict,
                   request: Request, req, prompts: list[list[int]], kind: str, echo: list[str] | None = None):
    if not loop.alive:
        raise APIError(503, "the engine loop has stopped (see the server log); restart `kiln serve`",
                       code="engine_stopped")
    jobs = []  # (request id, prompt ids, params)
    chat = kind == "chat.completion"
    model_default = defaults.get("max_tokens")  # generation_config.json's max_new_tokens: a default, not a cap
    prefix = "chatcmpl" if chat else "cmpl"
    base = f"{prefix}-{uuid.uuid4().hex}"  # the engine's request ids: unique, whatever the client sends
    # The response's id: vLLM's, from X-Request-Id or the request_id field when the client gives one
    given = request.headers.get("x-request-id") or req.request_id
    response_id = f"{prefix}-{given}" if given else base
    # vLLM's get_max_tokens: none given (chat; completions' explicit null, its omitted field being 16), the model's
    # default cut to the room left, else the rest of the context; a value given (completions' 16 included) is checked
    asked, is_default = req.requested_max_tokens(), False
    if asked is None and model_default is not None:
        asked, is_default = model_default, True
    # A batch's errors about one prompt name it, as LLM.generate's do ("prompt 1: ..."); job k is prompt k // n
    label = (lambda k: f"prompt {k // req.n}") if len(prompts) > 1 else None
    lead = (lambda p: f"prompt {p}: ") if label else (lambda p: "")
    for p, ids in enumerate(prompts):
        if req.prompt_only and engine.max_model_len - len(ids) < 1:
            # echo with max_tokens 0 samples one token, not shown (as vLLM): the engine would blame a max_tokens 1
            # the client never sent
            raise APIError(400, f"{lead(p)}this model's maximum context length is {engine.max_model_len} tokens, and "
                           f"your prompt has {len(ids)}: echo with max_tokens 0 still computes one token "
                           "after the prompt, so the prompt must leave room for it; shorten the prompt by "
                           "one token", param="prompt", code="context_length_exceeded")
        try:
            # The engine's own rule (runtime.prompt_limits), asked here for the number the 400s below name; the
            # engine gets it as the request's max_tokens. cut=False: a value the client sent past the context is a
            # 400, as vLLM's server refuses it (its engine, and so kiln's LLM, would cut it to the context).
            max_tokens = engine.max_tokens_for(len(ids), asked, is_default=is_default, cut=False)
        except RequestError as e:
            raise request_error(RequestError(lead(p) + str(e), param=e.param, code=e.code),
                                req.param_name(e.param)) from None
        try:
            req.check_min_tokens(max_tokens, is_default, lead(p))
            choices = req.sampling_params(max_tokens, defaults).choices()  # validated; n > 1: the seed rule there
            # the engine's checks of the ids in the params (stop_token_ids, logit_bias...), which are the request's,
            # not a prompt's: here, so that only a prompt's own fault reaches loop.add's label
            check_params_for_model(choices[0], engine.model.vocab)
        except RequestError as e:
            raise request_error(e, req.param_name(e.param)) from None
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
        await loop.add(jobs, sink, label)  # all at once: every choice starts in the same engine step
    except RequestError as e:  # none of them was added
        raise request_error(e, req.param_name(e.param)) from None
    except BaseException:
        loop.abort(rids)  # cancelled (client gone) while adding: one of them may be queued already
        raise
    choices = Choices(response_id, kind, served, rids, sum(len(p) for p in prompts),
                      req.return_token_ids, logprobs=req.engine_logprobs(), tokenizer=engine.tokenizer,
                      echo=None if echo is None else [t for t in echo for _ in range(req.n)],
                      prompt_only=req.prompt_only,
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
        # unexpected (a disconnect is a message, not an exception): its traceback says where it came from
        log.warning("reading from the client failed (%s: %s); aborting its request", type(e).__name__, e,
                    exc_info=True)
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
