"""The FastAPI app: OpenAI routes over one EngineLoop, with auth, limits, CORS and OpenAI-shaped errors.

Bodies are read by kiln.server.body (limits, JSON, Unicode, pydantic's errors as 400s); kiln.server.middleware holds
the API key check and the JSON 500 for anything unexpected; Starlette's CORSMiddleware, outermost, answers browsers'
preflights and puts the CORS headers on every response (errors included). A request's model is checked first, as
vLLM does, and all its engine requests (prompts x n) are added to the engine in one go. Besides the OpenAI routes,
vLLM's /tokenize, /detokenize, /version and /ping.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.middleware.cors import CORSMiddleware

from kiln import __version__
from kiln.chat_template import ChatTemplate, ChatTemplateError, chat_template_of
from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.server.body import read_json, validation_error
from kiln.server.engine_loop import EngineLoop
from kiln.server.fields import ignored_reason
from kiln.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.server.middleware import BearerAuth, CatchAll
from kiln.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    request_error,
)
from kiln.server.streaming import Choices, completion_body, sse_stream

log = logging.getLogger("kiln.server")
_GONE = object()  # put in a non-streaming request's sink when its client disconnects
MAX_BODY_BYTES = 32 << 20  # --max-body-bytes' default: a 131072-token context as token ids (~1 MiB) many times over
GUARDED = ("/v1", "/tokenize", "/detokenize")  # the routes --api-key guards


@dataclass
class ServerConfig:
    """model_name: the model id the server reports (in responses, /health and /metrics), or a list of ids (vLLM's
    --served-model-name): the first is reported, every one is listed in /v1/models and accepted as a request's model;
    model_aliases: more ids accepted as a request's model, not listed."""

    model_name: str | Sequence[str]
    api_key: str | None = None
    max_body_bytes: int | None = MAX_BODY_BYTES  # None or 0: no limit
    max_prompt_tokens: int | None = None  # None: the engine's max_model_len
    max_waiting: int | None = None  # requests queued (not yet running) before new ones get 503 (None: no limit)
    default_max_tokens: int = 16  # completions without max_tokens (chat defaults to the rest of the context)
    chat_template: ChatTemplate | None = None
    model_aliases: Sequence[str] = ()
    # CORS, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials
    allowed_origins: Sequence[str] = field(default_factory=lambda: ["*"])
    allowed_methods: Sequence[str] = field(default_factory=lambda: ["*"])
    allowed_headers: Sequence[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # The model's recommended sampling (LoadedModel.generation_defaults, vLLM's --generation-config auto), keyed by
    # SamplingParams field: applied to the request fields a client leaves unset (or sends as null)
    generation_defaults: Mapping[str, object] = field(default_factory=dict)
    # vLLM's --trust-request-chat-template: whether a request may bring its own chat template (chat_template)
    trust_request_chat_template: bool = False

    @property
    def model_names(self) -> list[str]:
        """The served model ids, the reported one first."""
        names = [self.model_name] if isinstance(self.model_name, str) else list(self.model_name)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"model_name: give one or more non-empty model ids, not {self.model_name!r}")
        return names


def _model_of(body: object) -> object:
    """The body's model field as sent (checked before the rest of the body is validated)."""
    return body.get("model") if isinstance(body, dict) else None


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    names = config.model_names
    served = names[0]  # what responses, /health and /metrics report, as vLLM reports its first name
    accepted = {*names, *config.model_aliases}
    metrics = ServerMetrics(served)
    loop = EngineLoop(engine, metrics)
    chat = config.chat_template or chat_template_of(engine.tokenizer)
    defaults = dict(config.generation_defaults)
    max_prompt = config.max_prompt_tokens or engine.max_model_len
    logged: set[str] = set()  # the ignored request fields logged so far: each once per server

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)  # waits for the step in flight: off the event loop

    app = FastAPI(title="kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop, app.state.metrics = loop, metrics
    app.state.draining = False  # set by DrainingServer when the shutdown drain begins

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, e: ValidationError) -> JSONResponse:
        err = validation_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(404)
    async def _not_found(request: Request, e) -> JSONResponse:  # OpenAI's type for an unknown URL too
        method, path = request.method, request.url.path
        routes = _routes(app)
        hint = ""
        if not path.startswith("/v1/") and f"{method} /v1{path}" in routes:  # an OpenAI base URL without /v1
            hint = f"did you mean {method} /v1{path}? "
        return JSONResponse(error_body(f"no route {method} {path}; {hint}kiln serves {', '.join(routes)}",
                                       "invalid_request_error"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, e) -> JSONResponse:
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}",
                                       "invalid_request_error"), status_code=405)

    if config.api_key:
        app.add_middleware(BearerAuth, api_key=config.api_key, guarded=GUARDED)
    app.add_middleware(CatchAll)  # outside BearerAuth, so it covers it too
    # Outermost: a preflight is answered before the API key is asked for, and every response (a 401, CatchAll's
    # 500) carries the CORS headers a browser needs to read it.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)

    def parse(model: type[BaseModel], body: object):
        """The body as `model` (a 400 for what it cannot take); each ignored field's name is logged once."""
        ignored: set[str] = set()
        req = model.model_validate(body, context={"ignored": ignored})
        for name in sorted(ignored - logged):
            logged.add(name)
            log.info("ignoring the request field %r (%s: it changes nothing kiln computes); logged once",
                     name, ignored_reason(name) or "metadata")
        return req

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) /health
    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:  # a load balancer stops sending requests; those in flight still finish
            err = APIError(503, "the server is shutting down: it finishes the requests in flight and takes no new "
                           "ones", code="server_shutting_down")
            return JSONResponse(err.body(), status_code=err.status)
        if not loop.alive:
            return JSONResponse(error_body("the engine loop is not running", "internal_error"), status_code=503)
        return JSONResponse({"status": "ok", "model": served, "device": str(engine.model.device)})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    created = int(time.time())

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kiln",
                "max_model_len": engine.max_model_len, "vocab_size": engine.model.vocab}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(n) for n in names]}

    def check_model(name: object) -> None:
        """A 404 for a model this server does not serve; none given (or "") is the served one, as in vLLM."""
        if isinstance(name, str) and name and name not in accepted:
            served_as = " or ".join(repr(n) for n in names)
            raise APIError(404, f"model {name!r} does not exist; this server serves {served_as} (GET /v1/models)",
                           param="model", code="model_not_found")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id or "(none)")
        return card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, config.max_body_bytes)
        check_model(_model_of(body))  # first, as vLLM: a wrong model is the error, not what its fields would be
        req = parse(CompletionRequest, body)
        req.check()
        given = req.prompts()
        keep = truncation(req)
        # Off the event loop: a long prompt's tokenization would stall every stream being served.
        prompts = await asyncio.to_thread(lambda: [_tokens(engine, p, max_prompt, add_special=req.add_special_tokens,
                                                           keep=keep) for p in given])
        echo = None
        if req.echo:  # the prompt's text: as sent, or decoded from its token ids
            echo = await asyncio.to_thread(lambda: [_prompt_text(engine, p, ids) for p, ids in zip(given, prompts,
                                                                                                    strict=True)])
        return await _generate(request, req, prompts, "text_completion", config.default_max_tokens, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, config.max_body_bytes)
        check_model(_model_of(body))
        req = parse(ChatCompletionRequest, body)
        req.check()
        text = render(req)
        if req.max_completion_tokens is not None:  # as in OpenAI and vLLM, it overrides the deprecated max_tokens
            req.max_tokens = req.max_completion_tokens
        keep = truncation(req)
        ids = await asyncio.to_thread(lambda: _tokens(engine, text, max_prompt, "messages",
                                                      add_special=req.add_special_tokens, keep=keep))
        return await _generate(request, req, [ids], "chat.completion", None)

    def truncation(req) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all); over max_model_len is a
        400, as in vLLM."""
        k = req.truncate_prompt_tokens
        if k is not None and k > engine.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens = {k} is greater than max_model_len = "
                           f"{engine.max_model_len}; select a smaller truncation size (or -1: the last max_model_len "
                           "tokens)", param="truncate_prompt_tokens", code="invalid_value")
        return engine.max_model_len if k == -1 else k

    @functools.lru_cache(maxsize=16)  # a client sends the same template with every request: parsed once
    def request_template(text: str) -> ChatTemplate:
        return ChatTemplate(text, bos_token=chat.bos_token, eos_token=chat.eos_token,
                            origin="the request's chat_template")

    def template_for(req: ChatCompletionRequest | TokenizeChatRequest) -> ChatTemplate:
        """The server's template, or (--trust-request-chat-template) the one the request brings."""
        text = req.request_template()
        if text is None:
            return chat
        if not config.trust_request_chat_template:  # as vLLM: a template is code the server runs
            raise APIError(400, "a chat template was passed with the request, but the server was not started with "
                           "--trust-request-chat-template, so it refuses templates from requests; omit "
                           "chat_template (the server's template applies), or restart the server with that flag",
                           param="chat_template")
        try:
            return request_template(text)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="chat_template") from None

    def render(req: ChatCompletionRequest | TokenizeChatRequest) -> str:
        """The conversation's prompt text, from the chat template (chat completions and /tokenize alike)."""
        template = template_for(req)
        kwargs = req.template_kwargs()
        extra = {"template_kwargs": kwargs} if kwargs else {}  # none: render is called as before
        try:
            return template.render(req.template_messages(), req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message, **extra)
        except ChatTemplateError as e:  # the template's raise_exception, or a message it cannot take
            raise APIError(400, str(e), param="chat_template" if template is not chat else "messages") from None

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's: a prompt's token ids ({"prompt"}), or a conversation's as chat completions renders it
        ({"messages"}); no length limit (count and max_model_len tell the client whether it fits)."""
        body = await read_json(request, config.max_body_bytes)
        check_model(_model_of(body))
        conversation = isinstance(body, dict) and "messages" in body
        req = parse(TokenizeChatRequest if conversation else TokenizeCompletionRequest, body)
        req.check()
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot tokenize text", param="prompt")
        text = render(req) if conversation else req.prompt
        param = "messages" if conversation else "prompt"
        ids = await asyncio.to_thread(_encode, engine, text, req.add_special_tokens, param)
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = await asyncio.to_thread(lambda: [token_str(i) for i in ids])
        return JSONResponse(out)

    @functools.cache
    def vocabulary() -> list[str | None]:
        """Every id's token string (read once: a big vocabulary takes a while)."""
        table = getattr(engine.tokenizer, "token_strings", None)
        return table() if table is not None else []

    def token_str(token_id: int) -> str:
        """The token's string in the vocabulary (Llama's "▁Hello", GPT-2's "Ġworld"), as vLLM's token_strs; its
        decoded text for an id the vocabulary lists no string for."""
        table = vocabulary()
        s = table[token_id] if 0 <= token_id < len(table) else None
        return s if s is not None else engine.tokenizer.decode([token_id])

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's: token ids -> their text; an id out of the vocabulary is a 400 naming it."""
        body = await read_json(request, config.max_body_bytes)
        check_model(_model_of(body))
        req = parse(DetokenizeRequest, body)
        vocab = engine.model.vocab
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}] = {t} is not a token id of this model; allowed: 0 .. {vocab - 1} "
                               f"(its vocabulary has {vocab} tokens)", param="tokens", code="invalid_value")
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot give token ids' text", param="tokens")
        text = await asyncio.to_thread(_decode_all, engine, req.tokens)
        return JSONResponse({"prompt": text})

    async def _generate(request: Request, req, prompts: list[list[int]], kind: str, default_max: int | None,
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

    return app


def _routes(app: FastAPI) -> list[str]:
    """The routes the app serves, as "METHOD /path" (for the 404's message)."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            out += [f"{m} {route.path_format}" for m in sorted(route.methods - {"HEAD"})]
    return out


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


def _prompt_text(engine: Engine, prompt: str | list[int], ids: list[int]) -> str:
    """What echo puts before the text: the prompt as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if engine.tokenizer is None:
        raise APIError(400, "echo of a prompt given as token ids needs the model's tokenizer to give its text, and "
                       "this model has none; omit echo (prompt_logprobs gives the prompt's logprobs)", param="echo")
    return engine.tokenizer.decode(ids)


def _encode(engine: Engine, text: str, add_special: bool, param: str, what: str = "text") -> list[int]:
    """The text's token ids, with (add_special) or without the special tokens the tokenizer adds. A tokenizer that
    adds none (the byte-level one) takes no such choice."""
    encode = engine.tokenizer.encode
    try:
        if "special" in inspect.signature(encode).parameters:
            return encode(text, special=add_special)
        return encode(text)
    except Exception as e:
        raise APIError(400, f"the {what} cannot be tokenized: {e}", param=param) from None


def _decode_all(engine: Engine, ids: list[int]) -> str:
    """/detokenize's text: special tokens' text kept, as vLLM's (transformers' decode default); a tokenizer whose
    decode takes no such choice decodes as it does."""
    decode = engine.tokenizer.decode
    if "skip_special_tokens" in inspect.signature(decode).parameters:
        return decode(ids, skip_special_tokens=False)
    return decode(ids)


def _tokens(engine: Engine, prompt: str | list[int], limit: int, param: str = "prompt", *,
            add_special: bool = True, keep: int | None = None) -> list[int]:
    """The prompt's token ids; `param` names the field it came from in errors (chat: "messages"). add_special: a
    text gets the special tokens the tokenizer adds (vLLM's add_special_tokens); keep: only the last `keep` tokens
    (truncate_prompt_tokens), before the length is checked."""
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send prompt as token ids", param=param)
        ids = _encode(engine, prompt, add_special, param, what="prompt")
    else:
        ids = list(prompt)
    if keep is not None and len(ids) > keep:
        ids = ids[len(ids) - keep:]
    if not ids:
        raise APIError(400, "the prompt is empty; give at least one token", param=param)
    if len(ids) > limit:
        raise APIError(400, f"the prompt has {len(ids)} tokens, over the limit of {limit} (the model's context or "
                       f"--max-prompt-tokens); shorten {'the messages' if param == 'messages' else 'it'}",
                       param=param, code="context_length_exceeded")
    return ids
