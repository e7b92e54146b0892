"""API keys: profiles in Redis under the sha256 of the key; raw keys are never stored or logged.

A proxy instance keeps a short-lived local cache of lookups so the request path does not wait
on Redis for every request, and so known keys keep working while Redis is away. The cache is
bounded (least recently used entries go first), and an unknown key is remembered only briefly:
a client sending a million distinct made-up keys costs Redis lookups, never the proxy's memory.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
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
    # surrogateescape: a header's undecodable bytes hash as those bytes instead of raising.
    return hashlib.sha256(raw_key.encode("utf-8", "surrogateescape")).hexdigest()


class KeyStore:
    """Keys in Redis, with two bounded local caches: known keys (``cache_ttl_s``, and served
    stale while Redis is away) and unknown ones (``miss_ttl_s``), apart, so that a flood of
    made-up keys cannot push out the keys of real clients."""

    def __init__(
        self,
        redis: aioredis.Redis,
        cache_ttl_s: float = 5.0,
        *,
        miss_ttl_s: float = 1.0,
        cache_size: int = 4096,
        miss_cache_size: int = 1024,
    ) -> None:
        self._redis = redis
        self._known = _Lru(cache_size, cache_ttl_s)
        self._misses = _Lru(miss_cache_size, miss_ttl_s)

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
        self._known.clear()
        return bool(doomed)

    async def lookup(self, raw_key: str) -> Profile | None:
        """The key's profile: local cache while fresh; a stale entry serves while Redis is away.
        (The caches are keyed by the key itself, so a hit costs no hashing.)"""
        now = time.monotonic()
        known = self._known.get(raw_key)
        if known is not None and known[1] > now:
            return known[0]
        miss = self._misses.get(raw_key)
        if known is None and miss is not None and miss[1] > now:
            return None
        digest = key_hash(raw_key)
        try:
            raw = await self._call(self._redis.hget(KEYS_HASH, digest))
        except LedgerUnavailable:
            if known is not None:
                return known[0]
            raise
        if not raw:
            self._known.drop(raw_key)
            self._misses.put(raw_key, None, now)
            return None
        profile = Profile.from_json(raw)
        self._known.put(raw_key, profile, now)
        return profile

    @property
    def cached(self) -> int:
        """Entries in the local caches (at most ``cache_size + miss_cache_size``)."""
        return len(self._known) + len(self._misses)

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (RedisError, OSError) as exc:
            raise LedgerUnavailable(f"redis: {exc}") from exc


class _Lru:
    """A bounded map of key -> (profile, expiry); the least recently used goes first."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size, self.ttl_s = size, ttl_s
        self._entries: OrderedDict[str, tuple[Profile | None, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[Profile | None, float] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, profile: Profile | None, now: float) -> None:
        self._entries[key] = (profile, now + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
