"""Operations endpoints: liveness, readiness (fails while no replica is ready), Prometheus.

``/readyz`` answers 200 while any replica is healthy (eval arms can be served), else 503::

    {"ready": bool, "replicas": {id: healthy}, "redis": bool,
     "pools": {id: "production" | "eval"}, "production_ready": bool,
     "redis_persistence": "aof" | "rdb" | "aof+rdb" | "none" | "unknown"}

``pools`` says which replicas take production traffic (the others serve eval leases only);
``production_ready`` is whether one of them could take a production request now (healthy, not
leased, draining or resetting). ``redis_persistence`` is what the ledger's Redis does to keep
its data, read once at start (``router.ledger.persistence``): ``none`` means a Redis restart
loses every record and key (also logged at start, as ``redis_without_persistence``).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from router.http.context import FLEET, LEDGER, METRICS


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def healthz(_request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    replicas = {r.id: r.healthy for r in fleet}
    ready = fleet.any_ready()
    body = {
        "ready": ready,
        "replicas": replicas,
        "redis": bool(request.app[LEDGER].stats().get("redis_up")),
        "pools": {r.id: r.settings.pool for r in fleet},
        "production_ready": fleet.production_ready(),
        "redis_persistence": request.app[LEDGER].persistence,
    }
    return _json(body, 200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


def routes() -> list[web.RouteDef]:
    return [
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
    ]
