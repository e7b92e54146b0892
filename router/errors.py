"""The proxy's errors: one tree, each with its HTTP status and OpenAI error type and code.

::

    KvlError                        status, OpenAI error type and code
     ├── ClientError                4xx: the client's mistake, never a 500
     │    ├── BadRequest            400 invalid_request_error (malformed JSON, bad fields)
     │    │    └── PromptTooLong    400 context_length_exceeded: more tokens than the model takes
     │    ├── Unauthorized          401 missing or unknown API key, wrong admin token
     │    ├── NotFound              404 unknown model, request id, run or replica
     │    ├── Conflict              409 the state does not allow it (e.g. a replica is leased)
     │    ├── PayloadTooLarge       413 body over the configured limit
     │    └── UnsupportedMediaType  415 a Content-Encoding the proxy cannot decode
     └── ServiceError               5xx: ours or a replica's
          ├── Unavailable           503 no replica can serve; eval without Redis (Retry-After)
          ├── UpstreamFailed        502 the replica failed after accepting the request
          └── GatewayTimeout        504 the replica made no progress for backend_timeout_s

Dependency errors (backends, Redis) are translated where they are caught. ``router.http.errors``
maps the tree to HTTP responses; anything else that reaches it is a bug, logged with its
traceback and answered with a plain 500.
"""

from __future__ import annotations


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


class PromptTooLong(BadRequest):
    code = "context_length_exceeded"


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


class UnsupportedMediaType(ClientError):
    status = 415
    code = "unsupported_content_encoding"


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


class GatewayTimeout(ServiceError):
    status = 504
    type = "timeout"
    code = "replica_timeout"
