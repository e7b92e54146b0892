"""The app's typed state keys and the small steps every front handler shares."""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp
from aiohttp import web

from router.dispatch import Dispatcher
from router.errors import BadRequest, Unauthorized, Unavailable
from router.eval.dispatch import EvalDispatcher
from router.eval.runs import Runs
from router.fleet import Fleet
from router.flight import Flight, Parsed
from router.http.parse import load_json
from router.ledger import Ledger, LedgerUnavailable
from router.ledger.connect import RedisClient
from router.ledger.keys import KeyStore
from router.ledger.records import Principal
from router.metrics import Metrics
from router.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
REDIS = web.AppKey("redis", RedisClient)
HTTP = web.AppKey("http", aiohttp.ClientSession)
FLEET = web.AppKey("fleet", Fleet)
LEDGER = web.AppKey("ledger", Ledger)
KEYS = web.AppKey("keys", KeyStore)
METRICS = web.AppKey("metrics", Metrics)
DISPATCH = web.AppKey("dispatch", Dispatcher)
EVAL = web.AppKey("eval", EvalDispatcher)
RUNS = web.AppKey("runs", Runs)
EPISODE_HEADER = "X-Kvl-Episode"

ANONYMOUS = Principal(name="anonymous")


def new_request_id() -> str:
    return secrets.token_hex(12)


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("X-Api-Key") or None


async def authenticate(request: web.Request) -> Principal:
    """The key's principal; 401 for a missing or unknown key unless anonymous use is allowed."""
    token = bearer(request)
    if token is None:
        if request.app[SETTINGS].allow_anonymous:
            return ANONYMOUS
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    try:
        profile = await request.app[KEYS].lookup(token)
    except LedgerUnavailable as exc:
        raise Unavailable(
            "cannot check this API key while Redis is unreachable", headers={"Retry-After": "1"}
        ) from exc
    if profile is None:
        raise Unauthorized("invalid API key")
    return Principal(name=profile.name, mode=profile.mode, profile=profile)


async def open_flight(request: web.Request, parsed: Parsed) -> Flight:
    """Admit the request: an eval key's to its run, any other through production routing."""
    principal: Principal = request["principal"]
    if principal.mode == "eval":
        return await request.app[EVAL].open(parsed, principal)
    return await request.app[DISPATCH].open(parsed, principal)


def episode(request: web.Request) -> str | None:
    """The client's episode label for run diffs (``X-Kvl-Episode``), at most 128 characters."""
    value = request.headers.get(EPISODE_HEADER, "").strip()
    if len(value) > 128:
        raise BadRequest(f"{EPISODE_HEADER} must be at most 128 characters")
    return value or None


async def read_json(request: web.Request) -> dict[str, Any]:
    return load_json(await request.read())
