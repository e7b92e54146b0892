"""Whether the ledger's Redis keeps its data across a restart: ``CONFIG GET appendonly`` and
``CONFIG GET save``, read once when a proxy (or ``kvledger up``) starts.

``aof`` (append-only file), ``rdb`` (snapshots), ``aof+rdb``, ``none`` (a restart loses every
record and key: the proxy logs ``redis_without_persistence`` once, a warning), or ``unknown``
(the server refuses CONFIG, as managed Redis services do; their persistence is theirs to say).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from router.ledger.errors import LedgerError, redis_call
from router.ledger.schema import text

WARNING = (
    "Redis keeps no data across a restart (appendonly no, no save points): a Redis restart"
    " loses every lineage record and API key; turn on appendonly (appendfsync everysec)"
)


def kind(config: Mapping[Any, Any]) -> str:
    """``aof``, ``rdb``, ``aof+rdb`` or ``none``, from CONFIG GET's answers (pure)."""
    values = {text(k): text(v) for k, v in config.items()}
    aof = values.get("appendonly", "no").strip().lower() == "yes"
    rdb = bool(values.get("save", "").strip())
    if aof and rdb:
        return "aof+rdb"
    return "aof" if aof else "rdb" if rdb else "none"


async def redis_persistence(client: aioredis.Redis, timeout_s: float = 2.0) -> str:
    """What the Redis behind ``client`` does to keep its data (see the module docstring)."""
    try:
        async with redis_call("read persistence", timeout_s):
            config = await client.config_get("appendonly")
            config.update(await client.config_get("save"))
    except LedgerError:  # refused (managed Redis: unknown command) or not answering
        return "unknown"
    if "appendonly" not in {text(k) for k in config}:
        return "unknown"  # a server that hides its configuration
    return kind(config)
