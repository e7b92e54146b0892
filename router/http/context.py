"""The app's typed state keys and the small steps every front handler shares.

Headers are the client's bytes like the body is: aiohttp decodes them as UTF-8 and keeps an
undecodable byte as a lone surrogate, which would fail later (hashing a key, writing a record).
So every header the proxy reads is checked here, once, and a bad one is a 4xx naming it: one
value only (a second ``Authorization`` is refused, not ignored), keys printable ASCII, the
episode label printable UTF-8 text. A body that cannot be read is a 400 like a body that is
not JSON; its ``Content-Encoding`` is decoded by ``router.http.decode`` (415 for a coding the
proxy does not know, 400 for data that is not in its coding).
"""

from __future__ import annotations

import os
import random
from typing import Any

import aiohttp
from aiohttp import web

from router.dispatch import Dispatcher
from router.errors import BadRequest, Unauthorized, Unavailable
from router.eval.dispatch import EvalDispatcher
from router.eval.runs import Runs
from router.fleet import Fleet
from router.flight import Flight, Parsed
from router.http.decode import decode_body
from router.http.parse import check_prompt_length, load_json
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


# Request ids must be unique, not secret (only the admin API reads a record by its id): 96
# random bits from a generator seeded by the OS, without a getrandom() system call a request.
_ids = random.Random(os.urandom(32))


def new_request_id() -> str:
    return _ids.getrandbits(96).to_bytes(12, "big").hex()


def single_header(request: web.BaseRequest, name: str) -> str | None:
    """The header's one value, or None; 400 when the client sent it more than once."""
    values = request.headers.getall(name, ())
    if len(values) > 1:
        raise BadRequest(f"send the {name} header once, not {len(values)} times", param=name)
    return values[0] if values else None


def _key(value: str, header: str) -> str:
    # Keys are printable ASCII (ours are URL-safe base64); anything else cannot be one.
    if not (value.isascii() and value.isprintable()):
        raise Unauthorized(f"invalid API key in {header}: keys are printable ASCII", param=header)
    return value


def bearer(request: web.BaseRequest) -> str | None:
    """The client's key: ``Authorization: Bearer KEY``, else ``X-Api-Key``; None if neither."""
    scheme, _, token = (single_header(request, "Authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return _key(token.strip(), "Authorization")
    api_key = single_header(request, "X-Api-Key")
    return _key(api_key, "X-Api-Key") if api_key else None


async def authenticate(request: web.BaseRequest, app: web.Application) -> Principal:
    """The key's principal; 401 for a missing or unknown key unless anonymous use is allowed."""
    token = bearer(request)
    if token is None:
        if app[SETTINGS].allow_anonymous:
            return ANONYMOUS
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    try:
        profile = await app[KEYS].lookup(token)
    except LedgerUnavailable as exc:
        raise Unavailable(
            "cannot check this API key while Redis is unreachable", headers={"Retry-After": "1"}
        ) from exc
    if profile is None:
        raise Unauthorized("invalid API key")
    return Principal(profile.name, profile.mode, profile)


async def open_flight(app: web.Application, parsed: Parsed, principal: Principal) -> Flight:
    """Admit the request: an eval key's to its run, any other through production routing."""
    if principal.mode == "eval":
        return await app[EVAL].open(parsed, principal)
    return await app[DISPATCH].open(parsed, principal)


def episode(request: web.BaseRequest) -> str | None:
    """The client's episode label for run diffs (``X-Kvl-Episode``), at most 128 characters."""
    value = (single_header(request, EPISODE_HEADER) or "").strip()
    if len(value) > 128 or not value.isprintable():  # an undecodable byte is not printable
        raise BadRequest(
            f"{EPISODE_HEADER} must be printable UTF-8 text of at most 128 characters",
            param=EPISODE_HEADER,
        )
    return value or None


async def read_json(request: web.BaseRequest) -> dict[str, Any]:
    """The body as a JSON object; 400 when it cannot be read, decoded or parsed."""
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:
        lines = str(exc.__cause__ or exc).strip().splitlines() or [type(exc).__name__]
        raise BadRequest(f"the request body could not be read: {lines[-1].strip()}") from exc
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None:
        # Two Content-Encoding lines are one list (RFC 9110, 5.3), as if joined by commas.
        encoding = ", ".join(request.headers.getall("Content-Encoding"))
    return load_json(decode_body(raw, encoding, request.client_max_size))


def check_prompt(app: web.Application, parsed: Parsed, param: str) -> None:
    """400 before any replica sees a prompt that is certainly too long for the model."""
    # The config's max_input_len, else the one the monitor read from the engine's own config.
    limits = [
        (r.settings.max_input_len or r.engine_max_input_len, r.settings.max_token_bytes)
        for r in app[FLEET].serving(parsed.model)
    ]
    check_prompt_length(parsed.model, parsed.request.prompt, limits, param)
