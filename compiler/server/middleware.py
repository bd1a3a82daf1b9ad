"""The server's ASGI middleware: the API key, and a JSON 500 for anything a route did not expect.

Both are plain ASGI middleware, not @app.middleware: Starlette's BaseHTTPMiddleware wraps `receive`, and the handlers
behind it never see a client disconnect.
"""

from __future__ import annotations

import hmac
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server.protocol import error_body

log = logging.getLogger("kiln.server")


class BearerAuth:
    """`--api-key`: the routes under `guarded` (the API: /v1, /tokenize, /detokenize) need 'Authorization: Bearer
    KEY'. A browser's CORS preflight, which carries no credentials, never gets here: CORSMiddleware, outside this
    one, answers it."""

    def __init__(self, app: ASGIApp, api_key: str, guarded: tuple[str, ...] = ("/v1",)):
        self.app, self.key, self.guarded = app, api_key.encode(), guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.guarded):
            # RFC 9110: the scheme name is case-insensitive ("bearer" is as good as "Bearer")
            scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                response = JSONResponse(error_body("invalid or missing API key; send the header 'Authorization: "
                                                   "Bearer <key>' with the key the server was started with",
                                                   "authentication_error", code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CatchAll:
    """An exception no handler turned into a response (a bug): a 500 in OpenAI's error shape, its traceback logged
    through the `kiln` logger. Without it uvicorn answers 'Internal Server Error' as plain text, which OpenAI
    clients cannot parse. The outermost of kiln's middleware, so it covers the others too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # not BaseException: a cancelled task (shutdown) is not a bug
            log.exception("internal error serving %s %s", scope.get("method"), scope.get("path"))
            if started:  # the response is under way and cannot become an error: uvicorn closes the connection
                return
            body = error_body(f"internal server error ({type(e).__name__}: {e}); this is a bug in kiln, the "
                              "server log has its traceback", "internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)
