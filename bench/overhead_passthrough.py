"""The floor of our stack: a bare aiohttp + uvloop pass-through to Triton's HTTP generate.

No keys, no routing, no ledger: the body goes upstream over one keep-alive session and the
answer comes back as it arrives (streams chunk by chunk). What kvledger costs above this is
what its own work costs.

    python -m bench.overhead_passthrough --port 9000 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    url = request.app[UPSTREAM] + request.path
    body = await request.read()
    headers = {"Content-Type": "application/json"}
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        if not request.path.endswith("_stream"):
            return web.Response(
                body=await upstream.read(),
                status=upstream.status,
                content_type=upstream.content_type,
            )
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def make_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v2/models/{model}/generate", forward)
    app.router.add_post("/v2/models/{model}/generate_stream", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvloop.install()
    web.run_app(
        make_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
