"""The Redis client: the one place outside the ledger's modules that needs its type opens it.

The proxy keeps short timeouts (a stalled Redis must not stall requests: the writer spools);
commands that read a large lineage allow longer ones.
"""

from __future__ import annotations

import redis.asyncio as aioredis

RedisClient = aioredis.Redis


def connect(
    url: str,
    *,
    timeout_s: float | None = 0.5,
    connect_timeout_s: float = 0.5,
    health_check_s: int = 5,
) -> RedisClient:
    """A client of the Redis at ``url`` (it connects on first use); ValueError for a bad URL.
    ``timeout_s`` None: reads wait as long as it takes (a subscriber)."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=health_check_s,
    )
