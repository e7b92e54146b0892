"""Cache state fingerprints (DESIGN.md §3): pure functions, the same here and in Redis.

``genesis(engine) = sha1("kvledger/1|" + engine)`` and ``step(state, digest) = sha1(state + "|" +
digest)``. The chain step must run inside one Redis Lua script so that several proxy instances
serving one replica keep one chain, and Redis Lua offers ``redis.sha1hex`` and no other hash: so
the chain is SHA-1. It identifies histories, it does not authenticate them, so SHA-1's collision
weakness does not matter here. ``step`` below is the exact Python twin of that script's step, and
a test holds them together. Request digests are computed only in Python, so they use SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

GENESIS_PREFIX = "kvledger/1|"


def genesis(engine_digest: str) -> str:
    """The state of an empty cache. Neither the replica id nor the generation enters it, so fresh
    caches of identical engines compare equal."""
    return hashlib.sha1((GENESIS_PREFIX + engine_digest).encode()).hexdigest()


def step(state: str, digest: str) -> str:
    """The state after one request with ``digest`` (what the Lua script computes in Redis)."""
    return hashlib.sha1((state + "|" + digest).encode()).hexdigest()


def fold(state: str, digests: list[str]) -> str:
    """The state after ``digests`` in order."""
    for digest in digests:
        state = step(state, digest)
    return state


def _canonical(value: Any) -> bytes:
    # A JSON array of strings cannot be confused with another one (every string is quoted and
    # escaped), and sorted keys make equal parameter mappings encode equally.
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def request_digest(model: str, prompt: str, params: Mapping[str, Any], output: str) -> str:
    """What one request put into the cache: model, prompt text, sampling parameters, output."""
    return RequestDigest(model, prompt, params).of(output)


class RequestDigest:
    """:func:`request_digest` in two halves: the request's part hashed when it is admitted
    (while the replica works), the output's when it is known. The hash is of the same bytes,
    ``[model, prompt, params, output]`` as canonical JSON: a list's JSON is its items' JSON
    between brackets, joined by commas."""

    __slots__ = ("_head",)

    def __init__(self, model: str, prompt: str, params: Mapping[str, Any]) -> None:
        head = _canonical([model, prompt, dict(params)])
        self._head = hashlib.sha256(head[:-1] + b",")  # without its closing bracket

    def of(self, output: str) -> str:
        digest = self._head.copy()
        digest.update(orjson.dumps(output) + b"]")
        return digest.hexdigest()


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def params_digest(params: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(dict(params))).hexdigest()


@dataclass(frozen=True, slots=True)
class ChainHead:
    """A replica's chain as Redis holds it: ``seq`` requests served since ``generation`` began."""

    replica: str
    generation: int
    seq: int
    state: str
    engine_digest: str
    known: bool = True  # False: the state descends from a cache nobody saw empty


@dataclass(slots=True)
class Advance:
    """The result of one chain step (``seq`` is the request's 0-based place in its generation).

    ``stale``: the request ran in an older generation than Redis holds; the chain did not move
    and ``seq`` and both states are None (``generation`` is the current one). ``unordered``: the
    request touched the cache but its order could not be guaranteed (an eval turn lost), so the
    chain moved to a fresh unknown state. ``known`` says whether ``state_before`` descends from a
    cache seen empty.
    """

    replica: str
    generation: int
    seq: int | None
    state_before: str | None
    state_after: str | None
    known: bool = True
    stale: bool = False
    unordered: bool = False
