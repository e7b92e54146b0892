"""The error tree of ``router.errors`` as HTTP: OpenAI-shaped bodies, one middleware.

Every ``KvlError`` becomes ``{"error": {"message", "type", "code", "param"}}`` with its status
and headers; aiohttp's own refusals (no route, wrong method, body too large) take the same
shape; anything else is a bug, logged with its traceback, answered with a plain 500.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from router.errors import (
    ClientError,
    KvlError,
    NotFound,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_log = structlog.get_logger("kvledger.errors")


def _text(value: str) -> str:
    # Messages quote what the client sent (a path, a header): an undecodable byte there is a
    # lone surrogate, which JSON cannot carry. Replace it rather than fail the error itself.
    return value if value.isascii() else value.encode("utf-8", "replace").decode("utf-8")


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    param = None if param is None else _text(param)
    return {"error": {"message": _text(message), "type": type_, "code": code, "param": param}}


def error_response(error: KvlError) -> web.Response:
    body = error_body(error.message, error.type, error.code, error.param)
    return web.Response(
        body=orjson.dumps(body),
        status=error.status,
        content_type="application/json",
        headers=error.headers,
    )


def _from_http(exc: web.HTTPException) -> KvlError:
    """aiohttp's own refusals (no route, wrong method, body too large) in our shape."""
    mapping: dict[int, type[KvlError]] = {404: NotFound, 413: PayloadTooLarge, 401: Unauthorized}
    cls = mapping.get(exc.status, ClientError if exc.status < 500 else ServiceError)
    error = cls(exc.reason if exc.status != 413 else "request body too large")
    error.status = exc.status
    if exc.status == 405:
        error.code = "method_not_allowed"
    return error


def error_answer(request: web.BaseRequest, exc: Exception) -> web.StreamResponse:
    """The response to an exception a handler raised (re-raised when it is a redirect or the
    like, which aiohttp answers itself)."""
    if isinstance(exc, KvlError):
        return error_response(exc)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return error_response(_from_http(exc))
    _log.exception("unhandled_error", path=request.path, exc_info=exc)
    return error_response(KvlError("internal error; see the proxy's log"))


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:
        return error_answer(request, exc)
