"""The proxy's front door: the generation routes served without aiohttp's router.

aiohttp's ``Application`` resolves every request through its router (a yarl URL, a match info,
the middleware chain, the response-prepare signals): a minimal handler cost 295k instructions a
request behind an ``Application`` with one middleware and 185k behind aiohttp's low-level
``Server`` (callgrind), and kvledger's request went from 1,178k to 1,112k without it.
:class:`Edge` is the low-level server's handler: the four generation routes (``POST
/v1/completions``, ``/v1/chat/completions``, ``/v2/models/{model}/generate`` and
``generate_stream``) are matched on the raw path and served directly, with the same error
answers as the application's middleware; anything else, including those paths with a query
string, a percent-escape or an ``Expect`` header, goes to the application as before, so every
other route, refusal and 404 is the application's own.

A request line without a version (HTTP/0.9, ``GET /``) is parsed by llhttp as version 0.9, and
aiohttp would answer it with an ``HTTP/0.9 200`` status line, which no HTTP/0.9 client expects
and no later one understands. The edge answers it 400 with an HTTP/1.0 status line, written
directly, and closes the connection.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import HttpVersion10, web

from router.http.errors import error_answer, error_body
from router.http.openai import serve_completion
from router.http.triton import serve_generate

RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

# What aiohttp's router would match as {model} (no slash or braces), without what it would
# decode or cut first (a percent-escape, a query, a fragment): those take the router's way.
_GENERATE = re.compile(r"/v2/models/([^/%?#{}]+)/(generate|generate_stream)")


class Edge:
    """The server's request handler: the generation routes here, the rest to ``fallback`` (the
    application's own handler)."""

    def __init__(self, app: web.Application, fallback: RequestHandler) -> None:
        self.app = app
        self.fallback = fallback

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.version < HttpVersion10:
            return _refuse_http09(request)
        serving = self._route(request)
        if serving is None:
            return await self.fallback(request)
        try:
            return await serving
        except Exception as exc:
            return error_answer(request, exc)

    def _route(self, request: web.BaseRequest) -> Awaitable[web.StreamResponse] | None:
        # Expect: 100-continue is answered by the application's router before its handler.
        if request.method != "POST" or "Expect" in request.headers:
            return None
        path = request.raw_path
        if path == "/v1/completions":
            return serve_completion(request, self.app, chat=False)
        if path == "/v1/chat/completions":
            return serve_completion(request, self.app, chat=True)
        found = _GENERATE.fullmatch(path)
        if found is None:
            return None
        model, kind = found.groups()
        return serve_generate(request, self.app, model, kind == "generate_stream")


_HTTP09 = orjson.dumps(
    error_body(
        "HTTP/0.9 request lines are not served; send 'METHOD /path HTTP/1.1'",
        "invalid_request_error",
        "invalid_request",
    )
)


def _refuse_http09(request: web.BaseRequest) -> web.StreamResponse:
    """400 with an HTTP/1.0 status line, then close: aiohttp writes the request's own version."""
    transport = request.transport
    if transport is not None and not transport.is_closing():
        head = (
            "HTTP/1.0 400 Bad Request\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(_HTTP09)}\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode("ascii") + _HTTP09)
        transport.close()
    # aiohttp's write of this response meets the closed transport and ends the connection.
    return web.Response(status=400)


def install(runner: web.AppRunner) -> None:
    """Serve ``runner``'s application through an :class:`Edge` (after ``runner.setup()``,
    before its sites start: each connection takes the handler when it opens)."""
    server = runner.server
    if server is None:
        raise RuntimeError("install the edge after runner.setup()")
    server.request_handler = Edge(runner.app, server.request_handler)
