"""API keys: profiles in Redis under the sha256 of the key; raw keys are never stored or logged.

A proxy instance keeps a short-lived local cache of lookups so the request path does not wait
on Redis for every request, and so known keys keep working while Redis is away.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.ledger.errors import LedgerUnavailable
from router.ledger.schema import KEY_NAMES, KEYS_HASH

Mode = Literal["production", "eval"]


@dataclass(frozen=True, slots=True)
class Profile:
    """What a key may do. ``cache`` and the rest only matter in eval mode."""

    name: str
    mode: Mode = "production"
    cache: str | None = None  # reset | off | replay:SNAPSHOT | shared
    replica: str | None = None  # pinned replica for eval runs
    idle_timeout_s: float = 600.0
    created_at: str = ""

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Profile:
        data: dict[str, Any] = orjson.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def key_hash(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


class KeyStore:
    def __init__(self, redis: aioredis.Redis, cache_ttl_s: float = 5.0) -> None:
        self._redis = redis
        self._ttl = cache_ttl_s
        self._cache: dict[str, tuple[Profile | None, float]] = {}

    async def create(self, profile: Profile) -> str:
        """Store the profile under a new key and return the key (shown once, never again)."""
        raw = "kvl-" + secrets.token_urlsafe(24)
        digest = key_hash(raw)
        if not await self._call(self._redis.hsetnx(KEY_NAMES, profile.name, digest)):
            raise ValueError(f"a key named '{profile.name}' exists; revoke it first")
        await self._call(self._redis.hset(KEYS_HASH, digest, profile.to_json()))
        return raw

    async def list(self) -> list[Profile]:
        entries = await self._call(self._redis.hgetall(KEYS_HASH))
        return sorted((Profile.from_json(v) for v in entries.values()), key=lambda p: p.name)

    async def revoke(self, name: str) -> bool:
        entries = await self._call(self._redis.hgetall(KEYS_HASH))
        doomed = [h for h, v in entries.items() if Profile.from_json(v).name == name]
        if doomed:
            await self._call(self._redis.hdel(KEYS_HASH, *doomed))
        await self._call(self._redis.hdel(KEY_NAMES, name))
        self._cache.clear()
        return bool(doomed)

    async def lookup(self, raw_key: str) -> Profile | None:
        """The key's profile: local cache while fresh; a stale entry serves while Redis is away."""
        digest = key_hash(raw_key)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            raw = await self._call(self._redis.hget(KEYS_HASH, digest))
        except LedgerUnavailable:
            if cached is not None and cached[0] is not None:
                return cached[0]
            raise
        profile = Profile.from_json(raw) if raw else None
        self._cache[digest] = (profile, now + self._ttl)
        return profile

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (RedisError, OSError) as exc:
            raise LedgerUnavailable(f"redis: {exc}") from exc
