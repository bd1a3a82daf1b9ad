"""The FastAPI app: OpenAI routes over one EngineLoop, with auth, limits, CORS and OpenAI-shaped errors.

Bodies are read by kiln.server.body (limits, JSON, Unicode, pydantic's errors as 400s); kiln.server.middleware holds
the API key check and the JSON 500 for anything unexpected; Starlette's CORSMiddleware, outermost, answers browsers'
preflights and puts the CORS headers on every response (errors included). A request's model is checked first, as
vLLM does, and all its engine requests (prompts x n) are added to the engine in one go. Besides the OpenAI routes,
vLLM's /tokenize, /detokenize, /version and /ping. ServerConfig is in kiln.server.config, a request's run on the
engine and its answer in kiln.server.generate, prompts' token ids in kiln.server.prompt_tokens.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.middleware.cors import CORSMiddleware

from kiln import __version__
from kiln.chat_template import ChatTemplate, ChatTemplateError, chat_template_of
from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.prompt_limits import prompt_keep
from kiln.server.body import read_json, validation_error
from kiln.server.config import MAX_BODY_BYTES, ServerConfig  # noqa: F401  (MAX_BODY_BYTES: imported from here too)
from kiln.server.engine_loop import EngineLoop
from kiln.server.fields import ignored_reason
from kiln.server.generate import _collect, generate  # noqa: F401  (_collect: tests import it from here)
from kiln.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.server.middleware import BearerAuth, CatchAll
from kiln.server.prompt_tokens import _decode_all, _encode, _prompt_text, _tokens
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

log = logging.getLogger("kiln.server")
GUARDED = ("/v1", "/tokenize", "/detokenize")  # the routes --api-key guards


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
        keep = truncation(req)  # cut here too: --max-prompt-tokens, echo and usage see the prompt the engine runs

        def tokens_of(i: int, prompt) -> list[int]:
            try:
                return _tokens(engine, prompt, max_prompt, add_special=req.add_special_tokens, keep=keep)
            except APIError as e:  # in a batch, name the prompt, as LLM.generate does
                if len(given) == 1:
                    raise
                raise APIError(e.status, f"prompt {i}: {e.message}", param=e.param, code=e.code) from None

        # Off the event loop: a long prompt's tokenization would stall every stream being served.
        prompts = await asyncio.to_thread(lambda: [tokens_of(i, p) for i, p in enumerate(given)])
        echo = None
        if req.echo:  # the prompt's text: as sent, or decoded from its token ids
            echo = await asyncio.to_thread(lambda: [_prompt_text(engine, p, ids) for p, ids in zip(given, prompts,
                                                                                                    strict=True)])
        return await _generate(request, req, prompts, "text_completion", echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, config.max_body_bytes)
        check_model(_model_of(body))
        req = parse(ChatCompletionRequest, body)
        req.check()
        text = render(req)
        keep = truncation(req)
        ids = await asyncio.to_thread(lambda: _tokens(engine, text, max_prompt, "messages",
                                                      add_special=req.add_special_tokens, keep=keep))
        return await _generate(request, req, [ids], "chat.completion")

    def truncation(req) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all), by the engine's rule
        (kiln.runtime.prompt_limits.prompt_keep, which the engine applies again, a no-op on a prompt cut here)."""
        try:
            return prompt_keep(req.truncate_prompt_tokens, engine.max_model_len)
        except RequestError as e:
            raise request_error(e) from None

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

    _generate = functools.partial(generate, loop, engine, config, served, defaults)

    return app


def _routes(app: FastAPI) -> list[str]:
    """The routes the app serves, as "METHOD /path" (for the 404's message)."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            out += [f"{m} {route.path_format}" for m in sorted(route.methods - {"HEAD"})]
    return out
