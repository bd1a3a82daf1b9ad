"""Reading a request's body: its size limit, JSON (nesting included), valid Unicode, and pydantic's errors as 400s.

Bodies are read and parsed here (not by FastAPI) so that an oversized body, bad JSON and wrong types all come back
as {"error": {...}} naming the limit or the field, with the status codes OpenAI uses.
"""

from __future__ import annotations

import json
import re

from fastapi import Request
from pydantic import ValidationError

from kiln.server.protocol import APIError

# How a lone UTF-16 surrogate can get into a parsed body: a \uD800-\uDFFF escape, or (json.loads decodes UTF-8 with
# "surrogatepass") the raw bytes of an encoded surrogate. Only a body that matches is searched field by field.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: Request, limit: int | None) -> object:
    """The body parsed, or an APIError: over `limit` bytes (413; None or 0: no limit), not JSON or nested too deeply
    (400 invalid_json), a lone surrogate in a string (400, naming the field and the character)."""
    size = request.headers.get("content-length")
    if limit and size is not None and size.isdigit() and int(size) > limit:
        raise too_large(limit, int(size))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if limit and len(body) > limit:
            raise too_large(limit)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    except RecursionError:  # json's parser recurses once per [ or {: a deep body exhausts Python's stack
        raise APIError(400, "the request body nests arrays / objects too deeply to parse (about a thousand levels "
                       "or more); send a flatter JSON object", code="invalid_json") from None
    if json.detect_encoding(body) != "utf-8" or _MAYBE_SURROGATE.search(body):
        check_unicode(data)
    return data


def too_large(limit: int, size: int | None = None) -> APIError:
    """The 413 for a body over `limit` bytes: the limit, and the flag that raises it."""
    size_text = f"of {size} bytes " if size is not None else ""
    mib = f"{limit / (1 << 20):g} MiB, " if limit >= 1 << 20 else ""
    return APIError(413, f"request body {size_text}exceeds the server's limit of {mib}{limit} bytes; start "
                    "`kiln serve` with a larger --max-body-bytes (0: no limit)", code="request_too_large")


def check_unicode(data: object) -> None:
    """A 400 naming the first string (value or field name) that holds a lone UTF-16 surrogate: valid JSON ("\\ud800"),
    but not Unicode text; a tokenizer, or the UTF-8 encoding of a response, fails on it later with no useful word."""
    stack: list[tuple[str, object]] = [("", data)]  # (dotted path, value): no recursion, however deep the body
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _refuse_surrogate(value, f"field {path or 'body'!r}", path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                _refuse_surrogate(key, f"the field name {ascii(key)}" + (f" in {path!r}" if path else ""),
                                  path or None)
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))


def _refuse_surrogate(text: str, what: str, param: str | None) -> None:
    if text.isascii() or not (m := _SURROGATE.search(text)):
        return
    raise APIError(400, f"{what} holds a lone UTF-16 surrogate ({ascii(m.group())[1:-1]}) at character {m.start()}, "
                   "which is not valid Unicode (a surrogate is only valid as half of a pair, such as "
                   "\\ud83d\\ude00); send valid UTF-8 text", param=param, code="invalid_value")


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(e: ValidationError) -> APIError:
    """Pydantic's first error as a 400 naming the field (dotted path) and what was wrong."""
    err = e.errors()[0]
    # Drop the union members pydantic puts in the path ("prompt.str", "prompt.list[int]"): name the field.
    field = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p in _TYPE_NAMES or "[" in str(p)))
    field = field or "body"
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {field!r}; remove it (see the OpenAI API reference for the fields)",
                        param=field, code="unknown_field")
    return APIError(400, f"field {field!r}: {err['msg']} (got {err.get('input')!r})"[:500], param=field,
                    code="invalid_type" if "type" in err["type"] else "invalid_value")
