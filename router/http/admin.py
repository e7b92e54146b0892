"""Admin API under /admin/, guarded by its own token (DESIGN.md §5).

Every endpoint wants ``Authorization: Bearer <admin token>``, the value of the environment
variable named by ``server.admin_token_env``; without that variable the API is switched off.

::

    GET    /admin/keys                          {"keys": [profile, ...]}  (never a key or hash)
    POST   /admin/keys                          201 {"key": shown once, "profile": {...}}
    DELETE /admin/keys/{name}                   {"revoked": name}
    GET    /admin/replicas                      {"replicas": [...], "redis": bool}
    POST   /admin/replicas/{id}/drain|undrain   {"id", "draining", "in_flight"}
    GET    /admin/lineage/{request_id}          the lineage record
    GET    /admin/lineage?count&replica&key&run {"records": [...]}, newest last
    GET    /admin/generations?replica&count     {"generations": [...]}, newest last

Errors join the tree of ``router.errors``: ``AdminDisabled`` (403) is a ``ClientError``; a wrong
or missing token is ``Unauthorized``; Redis unreachable on a read or write is ``Unavailable``.
Draining is this proxy instance's local view, like health: with several instances, drain each.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict
from typing import Any, TypeVar, cast

import orjson
import structlog
from aiohttp import web

from router.errors import BadRequest, ClientError, Conflict, NotFound, Unauthorized, Unavailable
from router.eval.profiles import REPLAY, ProfileError, check_fleet, now_iso, validate_profile
from router.fleet import ReplicaState
from router.http.context import FLEET, KEYS, LEDGER, RUNS, SETTINGS, read_json, single_header
from router.ledger import ChainHead, LedgerUnavailable

AdminHandler = Callable[[web.Request], Awaitable[web.Response]]
H = TypeVar("H", bound=Callable[[web.Request], Awaitable[web.StreamResponse]])
MAX_COUNT = 10_000
_log = structlog.get_logger("kvledger.admin")


class AdminDisabled(ClientError):
    """403: the proxy runs without an admin token, so nobody may use the admin API."""

    status = 403
    type = "permission_error"
    code = "admin_disabled"


def json_response(body: object, status: int = 200, **headers: str) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def _check_token(request: web.Request) -> None:
    settings = request.app[SETTINGS]
    if settings.admin_token is None:
        raise AdminDisabled(
            "admin API disabled: set the environment variable named by server.admin_token_env"
            f" ({settings.admin_token_env}) and restart the proxy"
        )
    scheme, _, token = (single_header(request, "Authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing admin token: send 'Authorization: Bearer <admin token>'")
    # Constant time, on bytes: compare_digest refuses non-ASCII str, and a header may hold any
    # (an undecodable byte arrives as a lone surrogate: surrogateescape gives the byte back).
    sent = token.strip().encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(sent, settings.admin_token.encode("utf-8", "surrogateescape")):
        _log.warning("admin_token_rejected", path=request.path, remote=request.remote)
        raise Unauthorized("invalid admin token")


def admin_only(handler: H) -> H:
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        _check_token(request)
        return await handler(request)

    return cast(H, guarded)


@contextlib.contextmanager
def redis_errors(what: str) -> Iterator[None]:
    try:
        yield
    except LedgerUnavailable as exc:
        raise Unavailable(
            f"cannot {what}: Redis is unreachable ({exc})", headers={"Retry-After": "1"}
        ) from exc


def query_params(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
    """The query parameters, empty ones dropped; an unknown one is a 400, since silently
    ignoring a misspelt filter would answer a different question."""
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {unknown}; known: {list(allowed)}")
    for name in allowed:
        if len(request.query.getall(name, ())) > 1:
            raise BadRequest(f"query parameter '{name}' given more than once", param=name)
    return {name: value for name, value in request.query.items() if value}


def count_param(query: Mapping[str, str], default: int) -> int:
    raw = query.get("count")
    if raw is None:
        return default
    # isascii first: str.isdigit() is true for digits int() refuses, such as '²'.
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_COUNT:
        raise BadRequest(f"count must be an integer from 1 to {MAX_COUNT}", param="count")
    return int(raw)


async def list_keys(request: web.Request) -> web.Response:
    with redis_errors("list keys"):
        profiles = await request.app[KEYS].list()
    return json_response({"keys": [asdict(p) for p in profiles]})


async def create_key(request: web.Request) -> web.Response:
    body = await read_json(request)
    store = request.app[RUNS].store
    try:
        profile = validate_profile(body, created_at=now_iso())
        with redis_errors("check the key against the fleet"):
            snapshot = (profile.cache or "").removeprefix(REPLAY)
            exists = snapshot != profile.cache and await store.snapshot(snapshot) is not None
            check_fleet(profile, await store.registry(), exists)
    except ProfileError as exc:
        raise BadRequest(exc.message, param=exc.param) from exc
    with redis_errors("create the key"):
        try:
            raw = await request.app[KEYS].create(profile)
        except ValueError as exc:  # the name is taken
            raise Conflict(str(exc), param="name") from exc
    _log.info("admin_key_created", name=profile.name, mode=profile.mode, cache=profile.cache)
    # The only time the key exists outside its owner's hands: keep it out of every cache.
    body = {"key": raw, "profile": asdict(profile)}
    return json_response(body, status=201, **{"Cache-Control": "no-store"})


async def revoke_key(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    with redis_errors("revoke the key"):
        revoked = await request.app[KEYS].revoke(name)
    if not revoked:
        raise NotFound(f"no key named '{name}'")
    _log.info("admin_key_revoked", name=name)
    return json_response({"revoked": name})


def _replica_entry(replica: ReplicaState, head: ChainHead | None) -> dict[str, Any]:
    """The local view, with the chain head from Redis when there is one."""
    return {
        "id": replica.id,
        "model": replica.settings.model,
        "healthy": replica.healthy,
        "draining": replica.draining,
        "leased_by": replica.leased_by,
        "in_flight": replica.in_flight,
        "reuse": replica.settings.reuse,
        "pool": replica.settings.pool,
        "generation": head.generation if head else replica.generation,
        "seq": head.seq if head else None,
        "state": head.state if head else None,
        "engine_digest": head.engine_digest if head else replica.engine_digest or None,
        "served": replica.served,
    }


async def list_replicas(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    heads: dict[str, ChainHead | None] = {}
    redis_up = True
    try:
        heads = await request.app[LEDGER].heads(r.id for r in fleet)
    except LedgerUnavailable:
        redis_up = False  # the local view is still worth showing: this is when it is needed
    entries = [_replica_entry(r, heads.get(r.id)) for r in fleet]
    return json_response({"replicas": entries, "redis": redis_up})


def _set_draining(draining: bool) -> AdminHandler:
    async def handler(request: web.Request) -> web.Response:
        replica_id = request.match_info["id"]
        fleet = request.app[FLEET]
        if replica_id not in fleet:
            raise NotFound(f"no replica '{replica_id}'; see GET /admin/replicas")
        replica = fleet[replica_id]
        replica.draining = draining
        _log.info("admin_replica_draining", replica=replica_id, draining=draining)
        return json_response(
            {"id": replica_id, "draining": draining, "in_flight": replica.in_flight}
        )

    handler.__name__ = "drain" if draining else "undrain"
    return handler


async def lineage_record(request: web.Request) -> web.Response:
    request_id = request.match_info["request_id"]
    with redis_errors("read the lineage"):
        record = await request.app[LEDGER].record(request_id)
    if record is None:
        raise NotFound(f"no lineage record for request '{request_id}'", param="request_id")
    return json_response(record)


async def lineage_tail(request: web.Request) -> web.Response:
    query = query_params(request, ("count", "replica", "key", "run"))
    count = count_param(query, default=50)
    with redis_errors("read the lineage"):
        records = await request.app[LEDGER].tail(
            count, replica=query.get("replica"), key=query.get("key"), run=query.get("run")
        )
    return json_response({"records": records})


async def generations(request: web.Request) -> web.Response:
    query = query_params(request, ("count", "replica"))
    count = count_param(query, default=100)
    with redis_errors("read the generations"):
        events = await request.app[LEDGER].generations(query.get("replica"), count)
    return json_response({"generations": events})


def routes() -> list[web.RouteDef]:
    return [
        web.get("/admin/keys", admin_only(list_keys)),
        web.post("/admin/keys", admin_only(create_key)),
        web.delete("/admin/keys/{name}", admin_only(revoke_key)),
        web.get("/admin/replicas", admin_only(list_replicas)),
        web.post("/admin/replicas/{id}/drain", admin_only(_set_draining(True))),
        web.post("/admin/replicas/{id}/undrain", admin_only(_set_draining(False))),
        web.get("/admin/lineage", admin_only(lineage_tail)),
        web.get("/admin/lineage/{request_id}", admin_only(lineage_record)),
        web.get("/admin/generations", admin_only(generations)),
    ]
