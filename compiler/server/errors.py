"""The server's errors in OpenAI's JSON shape (kiln.server.protocol re-exports them)."""

from __future__ import annotations

from typing import Any

from kiln.errors import KilnError, RequestError


class APIError(KilnError):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

    The one rule for a 400's code: the specific one given (context_length_exceeded, unknown_field, ...), else
    invalid_value when it names a parameter, as pydantic's range checks give; so no 400 naming a field has a null
    code, whichever route raised it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        if code is None and param is not None and status == 400:
            code = "invalid_value"
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def again(self) -> APIError:
        """A copy to raise: one error handed to many requests (a shutdown's) would pile up all their tracebacks."""
        return APIError(
            self.status, self.message, param=self.param, type=self.type, code=self.code, headers=self.headers
        )


# OpenAI's types; a 404 (unknown model or route) is an invalid_request_error there too, with code model_not_found
# for a model.
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "overloaded_error",
}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def request_error(e: RequestError, param: str | None = None) -> APIError:
    """The 400 for a RequestError (the engine's and SamplingParams' checks), coded by APIError's rule: the error's
    own code, else invalid_value when it names a parameter. param: the field as this request names it (default:
    the error's)."""
    return APIError(400, str(e), param=param or e.param, code=e.code)
