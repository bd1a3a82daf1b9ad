"""`kiln serve`: an OpenAI-compatible HTTP server over one engine loop.

    from kiln.server import ServerConfig, build_app
    app = build_app(llm_engine, ServerConfig(model_name="tiny-llama"))   # an ASGI app for uvicorn

Modules: protocol (request / response models: their bases in request_base, completions' in completion_request,
chat's in chat_request), errors (the error shape), fields (the request fields beyond
kiln's: ignored metadata, unsupported fields, typos), engine_loop (the thread that drives Engine.step and routes
outputs to per-request asyncio queues), body (reading and checking a request body),
middleware (API key, JSON 500s), metrics (Prometheus), streaming (responses and SSE), app (the FastAPI routes and
limits), drain (uvicorn's server with a bounded shutdown drain), background (serve_in_thread).
"""

from kiln.server.app import ServerConfig, build_app

__all__ = ["ServerConfig", "build_app"]
