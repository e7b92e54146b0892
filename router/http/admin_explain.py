"""``POST /admin/runs/explain``: proof by replay, streamed (same token as /admin/).

Body ``{"run_a", "run_b", "episode"?, "limit"?}``. The answer is ``application/x-ndjson``: one
JSON object per line as the work goes on (``{"event": "start" | "proved" | "cold" |
"cold_skipped", ...}``), then ``{"event": "result", "report": {...}}`` (see
``router.eval.explain``), or ``{"event": "error", "error": {...}}`` if it stopped. It takes a
verified reset and a replay per chain, so minutes are normal: the lines say where it is.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from router.errors import BadRequest, KvlError
from router.eval.explain import Explainer
from router.http.admin import admin_only, redis_errors
from router.http.context import RUNS, read_json
from router.http.errors import error_body
from router.ledger import LedgerError


def _args(body: dict[str, Any]) -> tuple[str, str, str | None, int | None]:
    unknown = sorted(set(body) - {"run_a", "run_b", "episode", "limit"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}", param=unknown[0])
    runs = [body.get("run_a"), body.get("run_b")]
    if not all(isinstance(r, str) and r for r in runs):
        raise BadRequest("body needs 'run_a' and 'run_b': two run ids", param="run_a")
    episode, limit = body.get("episode"), body.get("limit")
    if episode is not None and not isinstance(episode, str):
        raise BadRequest("'episode' must be a string", param="episode")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BadRequest("'limit' must be a positive integer", param="limit")
    return str(runs[0]), str(runs[1]), episode, limit


async def explain(request: web.Request) -> web.StreamResponse:
    run_a, run_b, episode, limit = _args(await read_json(request))
    with redis_errors("read the runs"):
        for run in (run_a, run_b):
            if await request.app[RUNS].store.get(run) is None:
                raise BadRequest(f"no run '{run}'", param="run_a" if run == run_a else "run_b")
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)

    async def emit(event: dict[str, Any]) -> None:
        await response.write(orjson.dumps(event) + b"\n")

    try:
        report = await Explainer(request.app[RUNS], emit).explain(
            run_a, run_b, episode=episode, limit=limit
        )
        await emit({"event": "result", "report": report})
    except KvlError as exc:
        await emit({"event": "error", **error_body(exc.message, exc.type, exc.code)})
    except LedgerError as exc:
        await emit({"event": "error", **error_body(str(exc), "service_unavailable", "redis")})
    await response.write_eof()
    return response


def routes() -> list[web.RouteDef]:
    return [web.post("/admin/runs/explain", admin_only(explain))]
