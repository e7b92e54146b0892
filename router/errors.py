"""The proxy's errors, and the one middleware that turns them into OpenAI-shaped responses.

::

    KvlError                        status, OpenAI error type and code
     ├── ClientError                4xx: the client's mistake, never a 500
     │    ├── BadRequest            400 invalid_request_error (malformed JSON, bad fields)
     │    ├── Unauthorized          401 missing or unknown API key, wrong admin token
     │    ├── NotFound              404 unknown model, request id, run or replica
     │    ├── Conflict              409 the state does not allow it (e.g. a replica is leased)
     │    └── PayloadTooLarge       413 body over the configured limit
     └── ServiceError               5xx: ours or a replica's
          ├── Unavailable           503 no replica can serve; eval without Redis (Retry-After)
          └── UpstreamFailed        502 the replica failed after accepting the request

Dependency errors (backends, Redis) are translated where they are caught; anything else that
reaches the middleware is a bug, logged with its traceback and answered with a plain 500.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_log = structlog.get_logger("kvledger.errors")


class KvlError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class ClientError(KvlError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class BadRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ClientError):
    status = 404
    code = "not_found"


class Conflict(ClientError):
    status = 409
    code = "conflict"


class PayloadTooLarge(ClientError):
    status = 413
    code = "request_too_large"


class ServiceError(KvlError):
    pass


class Unavailable(ServiceError):
    status = 503
    type = "service_unavailable"
    code = "unavailable"


class UpstreamFailed(ServiceError):
    status = 502
    type = "upstream_error"
    code = "replica_failed"


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


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


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except KvlError as error:
        return error_response(error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http(exc))
    except Exception:
        _log.exception("unhandled_error", path=request.path)
        return error_response(KvlError("internal error; see the proxy's log"))
