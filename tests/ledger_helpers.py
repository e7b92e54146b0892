"""What the ledger tests share: a Redis client fixture, a ledger, records, waits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
import structlog

from router.ledger import ChainHead, Ledger, LedgerConfig
from router.ledger.chain import request_digest, text_digest
from router.ledger.connect import connect
from tests.servers import LocalCluster, RedisServer

ENGINE = "trtllm-0.13|ensemble|v1"


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(
        redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    yield redis
    await redis.aclose()


@pytest.fixture(params=["single", "cluster"])
async def any_client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    """A client of a private single redis-server, then of the session's Redis Cluster (flushed
    first): the tests that take it run against both."""
    if request.param == "single":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
    else:
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        url = cluster.url
    redis = connect(url, timeout_s=2.0, connect_timeout_s=2.0)
    if request.param == "cluster":
        await redis.flushall(target_nodes="primaries")  # type: ignore[call-arg]
    yield redis
    await redis.aclose()


def make_ledger(redis: aioredis.Redis, spool: Path, **config: Any) -> Ledger:
    cfg = LedgerConfig(spool_path=spool, retry_interval_s=0.1, close_timeout_s=2.0, **config)
    return Ledger(redis, cfg, structlog.get_logger("kvledger.ledger"))


def record(
    i: int, *, run: str | None = None, generation: int = 1, replica: str = "r1"
) -> dict[str, Any]:
    """A record as dispatch makes it, before its chain step."""
    output = f"answer {i}"
    return {
        "request_id": f"req-{i:04d}",
        "replica": replica,
        "generation": generation,
        "engine_digest": ENGINE,
        "run": run,
        "warning": None,
        "pending": False,
        "digest": request_digest("ensemble", f"prompt {i}", {"seed": i}, output),
        "output_digest": text_digest(output),
        "status": "ok",
    }


def spool_line(rec: dict[str, Any]) -> bytes:
    """One line of the documented spool format: a record whose chain step is still due."""
    rec = {**rec, "pending": True}
    step = {
        "replica": rec["replica"],
        "generation": rec["generation"],
        "digest": rec["digest"],
        "exact": False,
        "tried_ms": None,
    }
    return orjson.dumps({"step": step, "record": rec}) + b"\n"


async def fresh_chain(ledger: Ledger, replica: str = "r1") -> ChainHead:
    """A chain for ``replica`` that starts at genesis (its cache proven empty)."""
    return await ledger.ensure_replica(replica, ENGINE, proven_empty=True, counter=0)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll: the writer works in the background, and tests wait for what it did, boundedly."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not reached within {timeout_s} s")


def written(ledger: Ledger, count: int) -> Callable[[], bool]:
    return lambda: bool(ledger.stats()["written_total"] == count)


async def lineage(redis: aioredis.Redis, replica: str = "r1") -> list[dict[str, Any]]:
    """Every record in the replica's lineage stream as stored, repeats included."""
    entries: list[Any] = await redis.xrange(f"kvl:{{replica:{replica}}}:lineage") or []
    return [orjson.loads(fields[b"r"]) for _id, fields in entries]
