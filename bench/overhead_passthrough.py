"""The floor of our stack: a bare aiohttp + uvloop pass-through to Triton's HTTP generate.

No keys, no routing, no ledger: the body goes upstream over one keep-alive session and the
answer comes back as it arrives (streams chunk by chunk). What kvledger costs above this is
what its own work costs.

``/collect/v2/models/{model}/generate`` is the same floor asking the replica as kvledger asks
it (issue 12, item 2): the body goes to ``generate_stream`` with ``"stream": true`` and the
events are collected into one answer (their texts joined, the last event's other outputs).

    python -m bench.overhead_passthrough --port 9000 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import orjson
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


async def collect(request: web.Request) -> web.Response:
    url = f"{request.app[UPSTREAM]}/v2/models/{request.match_info['model']}/generate_stream"
    body = orjson.loads(await request.read()) | {"stream": True}
    headers = {"Content-Type": "application/json"}
    async with request.app[SESSION].post(url, data=orjson.dumps(body), headers=headers) as upstream:
        raw = await upstream.read()
        if upstream.status != 200:
            return web.Response(body=raw, status=upstream.status)
    events = [orjson.loads(e[5:]) for e in raw.split(b"\n\n") if e.startswith(b"data:")]
    answer = events[-1] | {"text_output": "".join(e.get("text_output", "") for e in events)}
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


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
    app.router.add_post("/collect/v2/models/{model}/generate", collect)
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
