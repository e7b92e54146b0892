"""Runs, arms, snapshots and the replica registry: the Redis side of eval mode.

- ``kvl:{run:ID}:meta`` hash: the run (arm, key, cache, model, replica, status, times, reason,
  reset figures, the state it began from); ``kvl:{run:ID}:requests`` stream: each request's
  complete input (model, prompt, sampling parameters) and its chain step, for snapshots;
  ``kvl:{run:ID}:lineage`` (written by the ledger's writer) holds the records.
- ``kvl:runs`` sorted set (run id by start time), ``kvl:runs-live`` set (runs not yet ended).
- ``kvl:arm:NAME``: the arm's current run, expiring after the arm's idle timeout (renewed while
  its requests run), so an idle run ends by itself; ``kvl:arm-seq`` hash numbers each arm's runs.
- ``kvl:{run:ID}:owner``: the proxy instance beginning the run, with a short expiry its
  heartbeat renews; a beginning run without it lost its proxy and is failed by whoever notices.
- ``kvl:snapshots`` hash: name -> snapshot JSON (requests, fingerprint, engine digest).
- ``kvl:replicas`` hash: replica id -> {model, reuse}, written by every proxy at start, so that
  ``kvledger keys create --cache off`` can check the fleet without a proxy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from router.ledger.errors import redis_call
from router.ledger.schema import PREFIX, REPLICAS, text

RUNS = PREFIX + "runs"
RUNS_LIVE = PREFIX + "runs-live"
ARM_SEQ = PREFIX + "arm-seq"
SNAPSHOTS = PREFIX + "snapshots"
# A run's request stream keeps this many entries; a snapshot can cover at most that many.
REQUESTS_MAXLEN = 1_000_000
PAGE = 1000


def meta_key(run: str) -> str:
    return f"{PREFIX}{{run:{run}}}:meta"


def requests_key(run: str) -> str:
    return f"{PREFIX}{{run:{run}}}:requests"


def arm_key(arm: str) -> str:
    return f"{PREFIX}arm:{arm}"


def owner_key(run: str) -> str:
    return f"{PREFIX}{{run:{run}}}:owner"


def _fields(values: Mapping[str, str]) -> dict[FieldT, EncodableT]:
    return dict(values.items())


def _decode(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


class RunStore:
    def __init__(self, client: aioredis.Redis, timeout_s: float = 2.0) -> None:
        self._client = client
        self._timeout = timeout_s

    # Arms -------------------------------------------------------------------------------------

    async def current(self, arm: str) -> str | None:
        async with redis_call("read arm", self._timeout):
            raw = await self._client.get(arm_key(arm))
        return None if raw is None else text(raw)

    async def claim(self, arm: str, run: str, ttl_ms: int) -> bool:
        """Make ``run`` the arm's current run unless it has one."""
        async with redis_call("claim arm", self._timeout):
            return bool(await self._client.set(arm_key(arm), run, nx=True, px=ttl_ms))

    async def number(self, arm: str) -> int:
        async with redis_call("number run", self._timeout):
            return int(await self._client.hincrby(ARM_SEQ, arm, 1))

    async def touch(self, arm: str, run: str, ttl_ms: int) -> bool:
        """Keep the arm's current run alive for another idle timeout; False when the arm no
        longer points at ``run`` (it expired, or another run took its place)."""
        async with redis_call("touch arm", self._timeout):
            current = await self._client.get(arm_key(arm))
            if current is None or text(current) != run:
                return False
            return bool(await self._client.set(arm_key(arm), run, xx=True, px=ttl_ms))

    # The begin's owner ------------------------------------------------------------------

    async def own(self, run: str, owner: str, ttl_ms: int) -> None:
        """Say (again) that ``owner`` is beginning ``run``, for ``ttl_ms``."""
        async with redis_call("own run", self._timeout):
            await self._client.set(owner_key(run), owner, px=ttl_ms)

    async def owner_alive(self, run: str) -> bool:
        async with redis_call("read run owner", self._timeout):
            return bool(await self._client.exists(owner_key(run)))

    async def disown(self, run: str) -> None:
        async with redis_call("disown run", self._timeout):
            await self._client.delete(owner_key(run))

    async def release(self, arm: str, run: str) -> None:
        """The arm has no current run any more (if ``run`` still is it)."""
        async with redis_call("release arm", self._timeout):
            if await self.current(arm) == run:
                await self._client.delete(arm_key(arm))

    # Runs -------------------------------------------------------------------------------------

    async def create(self, run: str, fields: Mapping[str, str], at_ms: int) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.hset(meta_key(run), mapping=_fields(fields))
        pipe.zadd(RUNS, {run: at_ms})
        pipe.sadd(RUNS_LIVE, run)
        async with redis_call("create run", self._timeout):
            await pipe.execute()

    async def update(self, run: str, fields: Mapping[str, str], *, ended: bool = False) -> None:
        pipe = self._client.pipeline(transaction=False)
        if fields:
            pipe.hset(meta_key(run), mapping=_fields(fields))
        if ended:
            pipe.srem(RUNS_LIVE, run)
        async with redis_call("update run", self._timeout):
            await pipe.execute()

    async def get(self, run: str) -> dict[str, str] | None:
        async with redis_call("read run", self._timeout):
            raw = await self._client.hgetall(meta_key(run))
        return _decode(raw) or None

    async def live(self) -> list[str]:
        async with redis_call("read live runs", self._timeout):
            return sorted(text(r) for r in await self._client.smembers(RUNS_LIVE))

    async def recent(self, count: int) -> list[dict[str, str]]:
        """The newest ``count`` runs, newest first."""
        async with redis_call("list runs", self._timeout):
            ids = [text(r) for r in await self._client.zrevrange(RUNS, 0, count - 1)]
            pipe = self._client.pipeline(transaction=False)
            for run in ids:
                pipe.hgetall(meta_key(run))
            metas = await pipe.execute()
        return [_decode(m) for m in metas if m]

    # A run's requests ---------------------------------------------------------------------

    async def add_request(self, run: str, entry: Mapping[str, Any]) -> None:
        async with redis_call("record request", self._timeout):
            await self._client.xadd(
                requests_key(run),
                {"e": orjson.dumps(entry)},
                maxlen=REQUESTS_MAXLEN,
                approximate=True,
            )

    async def requests(self, run: str) -> list[dict[str, Any]]:
        """The run's recorded requests in order, read a page at a time (a large run would
        not fit in one call within the proxy's socket timeout)."""
        out: list[dict[str, Any]] = []
        low = "-"
        while True:
            async with redis_call("read requests", self._timeout):
                page = await self._client.xrange(requests_key(run), low, "+", count=PAGE)
            entries = list(page or [])
            for _id, fields in entries:
                raw = (fields or {}).get(b"e") or (fields or {}).get("e")
                if raw is not None:
                    out.append(orjson.loads(raw))
            if len(entries) < PAGE:
                return out
            low = "(" + text(entries[-1][0])

    # Snapshots ----------------------------------------------------------------------------

    async def save_snapshot(self, name: str, snapshot: Mapping[str, Any]) -> bool:
        async with redis_call("save snapshot", self._timeout):
            return bool(await self._client.hsetnx(SNAPSHOTS, name, orjson.dumps(snapshot)))

    async def snapshot(self, name: str) -> dict[str, Any] | None:
        async with redis_call("read snapshot", self._timeout):
            raw = await self._client.hget(SNAPSHOTS, name)
        if raw is None:
            return None
        found: dict[str, Any] = orjson.loads(raw)
        return found

    async def snapshots(self) -> list[dict[str, Any]]:
        async with redis_call("list snapshots", self._timeout):
            raw = await self._client.hvals(SNAPSHOTS)
        return sorted((orjson.loads(v) for v in raw), key=lambda s: str(s.get("name")))

    async def delete_snapshot(self, name: str) -> bool:
        async with redis_call("delete snapshot", self._timeout):
            return bool(await self._client.hdel(SNAPSHOTS, name))

    # The replica registry -----------------------------------------------------------------

    async def register(self, replicas: Mapping[str, Mapping[str, Any]]) -> None:
        mapping = {rid: orjson.dumps(dict(info)) for rid, info in replicas.items()}
        async with redis_call("register replicas", self._timeout):
            await self._client.hset(REPLICAS, mapping=mapping)  # type: ignore[arg-type]

    async def missing(self, replicas: list[str]) -> bool:
        """Whether any of ``replicas`` is not registered (Redis lost its data, say)."""
        async with redis_call("check replicas", self._timeout):
            return any(v is None for v in await self._client.hmget(REPLICAS, replicas))

    async def registry(self) -> dict[str, dict[str, Any]]:
        async with redis_call("read replicas", self._timeout):
            raw = await self._client.hgetall(REPLICAS)
        return {text(k): orjson.loads(v) for k, v in raw.items()}
