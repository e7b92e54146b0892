"""kvledger's plumbing alone: what its request path costs before any of its own work.

The same parts as kvledger's path, and nothing else: aiohttp's low-level server (as the edge,
``router/http/edge.py``), the replica asked over kvledger's HTTP/1.1 wire
(``backends/triton_http_wire.py``: ``generate`` for one answer, as kvledger asks for a
non-streamed request), and one Redis round trip on kvledger's Redis wire
(``router/ledger/wire.py``: a ``SET`` of a small record, where kvledger runs its chain step).
No key, no parsing beyond the JSON, no policy, no lineage record, no metrics. What kvledger costs
above this is what its own per-request work costs; what this costs above the bare pass-through
is what its design (its own wires, one Redis call) costs.

    python -m bench.overhead_plumbing --port 9000 --upstream http://127.0.0.1:8000 \\
        --redis-port 6379 --model trivial
"""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson
import uvloop
from aiohttp import web

from backends.triton_http_wire import Pool
from router.ledger.wire import Wire


async def serve(port: int, upstream: str, redis_port: int, model: str) -> None:
    pool = Pool(upstream, 10.0)
    wire = Wire("127.0.0.1", redis_port)
    path = f"/v2/models/{model}/generate"

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(text="ok")  # readiness
        body = orjson.loads(await request.read())
        request_id = os.urandom(12).hex()
        ask = {
            "id": request_id,
            "text_input": body["text_input"],
            "max_tokens": body.get("max_tokens", 16),
            "stream": False,
            "exclude_input_in_output": True,
        }
        response, connection = await pool.post(path, orjson.dumps(ask))
        outputs = orjson.loads(await response.read_all())
        pool.release(response, connection)
        record = {"request_id": request_id, "replica": "r1", "generation": 1, "seq": 1}
        await wire.call("SET", "plumbing:" + request_id, orjson.dumps(record), "EX", 60)
        answer = {"model_name": model, "text_output": outputs["text_output"], "kvledger": record}
        headers = {"X-Request-Id": request_id, "X-Kvl-Replica": "r1"}
        return web.Response(
            body=orjson.dumps(answer), content_type="application/json", headers=headers
        )

    runner = web.ServerRunner(web.Server(handle))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--redis-port", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream, args.redis_port, args.model))


if __name__ == "__main__":
    main()
