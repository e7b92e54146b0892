"""Admin API for eval mode: runs, snapshots and the verified reset (same token as /admin/).

::

    GET    /admin/runs?arm&count                {"runs": [...]}, newest first
    POST   /admin/runs {"arm", "model"?}        201 {"run": {...}}: lease, reset or replay, live
    GET    /admin/runs/{id}                     {"run": {...}, "records": {counts}}
    POST   /admin/runs/{id}/end                 {"run": {...}}
    POST   /admin/replicas/{id}/reset           the verified reset's report (409 if leased)
    POST   /admin/replicas/{id}/move-runs       drain it and move its runs off (failover):
                                                {"id", "draining", "runs": [{run, moved, ...}]}
    GET    /admin/snapshots                     {"snapshots": [...]} (without their requests)
    POST   /admin/snapshots                     201 {"snapshot": {...}}; body {"name", and
                                                "from_run" [, "upto"] or "requests" [, "model"]}
    GET    /admin/snapshots/{name}              the snapshot, requests included
    DELETE /admin/snapshots/{name}              {"deleted": name}

A run begun here waits for its reset (or replay) to finish before it answers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from aiohttp import web

from router.errors import BadRequest, Conflict, NotFound, Unavailable
from router.eval.failover import moves
from router.eval.profiles import NAME
from router.eval.reset import ResetFailed
from router.eval.snapshots import from_requests, from_run, summary
from router.http.admin import admin_only, count_param, json_response, query_params, redis_errors
from router.http.context import EVAL, FLEET, KEYS, LEDGER, RUNS, SETTINGS, read_json
from router.http.parse import parse_completion
from router.ledger.keys import Profile


def _model(request: web.Request, body: dict[str, Any]) -> str:
    models = request.app[SETTINGS].models
    model = body.get("model")
    if model is None:
        return models[0]
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, one of {list(models)}", param="model")
    if model not in models:
        raise NotFound(f"model '{model}' is not served here; served: {list(models)}", param="model")
    return str(model)


async def _arm(request: web.Request, name: Any) -> Profile:
    if not isinstance(name, str) or not name:
        raise BadRequest("body needs 'arm': the name of an eval key", param="arm")
    with redis_errors("look up the arm"):
        profiles = await request.app[KEYS].list()
    for profile in profiles:
        if profile.name == name:
            if profile.mode != "eval":
                raise BadRequest(f"key '{name}' is a production key, not an eval arm", param="arm")
            return profile
    raise NotFound(f"no key named '{name}'", param="arm")


async def list_runs(request: web.Request) -> web.Response:
    query = query_params(request, ("arm", "count"))
    with redis_errors("list runs"):
        runs = await request.app[RUNS].store.recent(count_param(query, default=50))
    if "arm" in query:
        runs = [r for r in runs if r.get("arm") == query["arm"]]
    return json_response({"runs": runs})


async def begin_run(request: web.Request) -> web.Response:
    body = await read_json(request)
    profile = await _arm(request, body.get("arm"))
    with redis_errors("begin the run"):
        meta = await request.app[RUNS].begin(profile, _model(request, body))
    return json_response({"run": meta}, status=201)


async def show_run(request: web.Request) -> web.Response:
    run = request.match_info["id"]
    with redis_errors("read the run"):
        meta = await request.app[RUNS].store.get(run)
        if meta is None:
            raise NotFound(f"no run '{run}'")
        records = await request.app[LEDGER].run_records(run)
    counts = {
        "requests": len(records),
        "status": dict(Counter(str(r.get("status")) for r in records)),
        "verified": sum(1 for r in records if r.get("verified") is True),
        "not_verified": sum(1 for r in records if r.get("verified") is False),
        "reused_blocks": sum(int(r.get("reused_blocks") or 0) for r in records),
        "last_state": records[-1].get("state_after") if records else meta.get("state"),
    }
    return json_response({"run": {**meta, "moves": moves(meta)}, "records": counts})


async def end_run(request: web.Request) -> web.Response:
    with redis_errors("end the run"):
        meta = await request.app[RUNS].end(request.match_info["id"], "ended by the admin API")
    return json_response({"run": meta})


async def reset_replica(request: web.Request) -> web.Response:
    replica_id = request.match_info["id"]
    fleet = request.app[FLEET]
    if replica_id not in fleet:
        raise NotFound(f"no replica '{replica_id}'; see GET /admin/replicas")
    replica = fleet[replica_id]
    if replica.leased_by is not None:
        raise Conflict(f"replica {replica_id} is leased by run {replica.leased_by}; end it first")
    runs = request.app[RUNS]
    try:
        report = await runs.resets.reset(replica, reason="verified reset: admin request")
    except ResetFailed as exc:
        raise Unavailable(f"reset failed: {exc.message}", headers={"Retry-After": "5"}) from exc
    return json_response(
        {
            "replica": report.replica,
            "generation": report.generation,
            "state": report.state,
            "waited_ms": round(report.waited_s * 1000),
            "reload_ms": round(report.reload_s * 1000),
            "duration_ms": round(report.total_s * 1000),
        }
    )


async def move_runs(request: web.Request) -> web.Response:
    """Drain the replica (this proxy instance) and move the runs leased on it elsewhere. A
    replica this instance is not configured with (removed from the config) is not drained, but
    the runs that still hold it move to this instance's replicas."""
    replica_id = request.match_info["id"]
    fleet = request.app[FLEET]
    known = replica_id in fleet
    if known:
        fleet[replica_id].draining = True
        why = f"replica {replica_id} drained by the admin (--move-runs)"
    else:
        why = f"replica {replica_id} is not in this proxy's configuration (--move-runs)"
    with redis_errors("move the runs"):
        done = await request.app[EVAL].mover.move_off(replica_id, why)
    if not known and not done:
        raise NotFound(f"no replica '{replica_id}' and no live run on it; see GET /admin/replicas")
    return json_response({"id": replica_id, "draining": known, "runs": done})


async def list_snapshots(request: web.Request) -> web.Response:
    with redis_errors("list snapshots"):
        snapshots = await request.app[RUNS].store.snapshots()
    return json_response({"snapshots": [summary(s) for s in snapshots]})


def _requests(request: web.Request, raw: Any, model: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'requests' must be a non-empty list of completion bodies")
    limit = request.app[SETTINGS].limits.max_tokens
    out = []
    for i, body in enumerate(raw, 1):
        if not isinstance(body, dict):
            raise BadRequest(f"requests[{i}] is not a JSON object", param="requests")
        try:
            parsed = parse_completion({"model": model, **body}, f"snapshot-{i}", limit)
        except BadRequest as exc:
            raise BadRequest(f"requests[{i}]: {exc.message}", param="requests") from exc
        out.append(
            {
                "model": parsed.model,
                "prompt": parsed.request.prompt,
                "params": parsed.request.sampling(),
            }
        )
    return out


def _from_run(body: dict[str, Any]) -> tuple[str, int | None]:
    source, upto = body["from_run"], body.get("upto")
    if not isinstance(source, str) or not source:
        raise BadRequest("'from_run' must be a run id such as 'arm.1'", param="from_run")
    if upto is not None and (not isinstance(upto, int) or isinstance(upto, bool)):
        raise BadRequest("'upto' must be an integer", param="upto")
    return source, upto


async def save_snapshot(request: web.Request) -> web.Response:
    body = await read_json(request)
    name = body.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest("'name' must be 1 to 64 characters from A-Z a-z 0-9 _ . -", param="name")
    runs = request.app[RUNS]
    with redis_errors("save the snapshot"):
        if await runs.store.snapshot(name) is not None:
            raise Conflict(f"a snapshot named '{name}' exists; delete it first", param="name")
        if body.get("from_run") is not None:
            source, upto = _from_run(body)
            snapshot = await from_run(runs.store, name, source, upto)
        else:
            model = _model(request, body)
            requests = _requests(request, body.get("requests"), model)
            snapshot = await from_requests(
                runs, request.app[FLEET], request.app[LEDGER], name, model, requests
            )
        if not await runs.store.save_snapshot(name, snapshot):
            raise Conflict(f"a snapshot named '{name}' exists; delete it first", param="name")
    return json_response({"snapshot": summary(snapshot)}, status=201)


async def show_snapshot(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    with redis_errors("read the snapshot"):
        snapshot = await request.app[RUNS].store.snapshot(name)
    if snapshot is None:
        raise NotFound(f"no snapshot '{name}'")
    return json_response(snapshot)


async def delete_snapshot(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    with redis_errors("delete the snapshot"):
        if not await request.app[RUNS].store.delete_snapshot(name):
            raise NotFound(f"no snapshot '{name}'")
    return json_response({"deleted": name})


def routes() -> list[web.RouteDef]:
    return [
        web.get("/admin/runs", admin_only(list_runs)),
        web.post("/admin/runs", admin_only(begin_run)),
        web.get("/admin/runs/{id}", admin_only(show_run)),
        web.post("/admin/runs/{id}/end", admin_only(end_run)),
        web.post("/admin/replicas/{id}/reset", admin_only(reset_replica)),
        web.post("/admin/replicas/{id}/move-runs", admin_only(move_runs)),
        web.get("/admin/snapshots", admin_only(list_snapshots)),
        web.post("/admin/snapshots", admin_only(save_snapshot)),
        web.get("/admin/snapshots/{name}", admin_only(show_snapshot)),
        web.delete("/admin/snapshots/{name}", admin_only(delete_snapshot)),
    ]
