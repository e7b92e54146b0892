"""Reading the ledger back: one record, the tail of the lineage, a run, generations, heads.

The lineage streams may hold a record twice (a batch written again after a crash or a lost
reply); request ids are unique, so readers keep the first copy of each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from router.ledger.chain import ChainHead
from router.ledger.errors import redis_call
from router.ledger.schema import (
    GENERATIONS,
    HEAD_FIELDS,
    LINEAGE,
    cache_key,
    entry_record,
    head_from,
    request_key,
    run_lineage_key,
    text,
)

PAGE = 1000
# tail() with a filter stops after this many entries, so a rare key cannot scan a million.
TAIL_SCAN_LIMIT = 100_000

Entry = tuple[Any, dict[Any, Any]]


class LedgerReader:
    def __init__(self, client: aioredis.Redis, timeout_s: float) -> None:
        self._client = client
        self._timeout = timeout_s

    async def record(self, request_id: str) -> dict[str, Any] | None:
        async with redis_call("get record", self._timeout):
            raw = await self._client.get(request_key(request_id))
        if raw is None:
            return None
        record: dict[str, Any] = orjson.loads(raw)
        return record

    async def tail(
        self,
        count: int = 50,
        replica: str | None = None,
        key: str | None = None,
        run: str | None = None,
    ) -> list[dict[str, Any]]:
        """The newest ``count`` records that match, newest last."""

        def wanted(record: dict[str, Any]) -> bool:
            return (replica is None or record.get("replica") == replica) and (
                key is None or record.get("key") == key
            )

        if run is not None:
            return [r for r in await self.run_records(run) if wanted(r)][-count:]
        found: list[dict[str, Any]] = []
        seen: set[str] = set()
        scanned = 0
        async for entries in self._pages_backwards(LINEAGE):
            scanned += len(entries)
            found.extend(r for r in _records(entries, seen) if wanted(r))
            if len(found) >= count or scanned >= TAIL_SCAN_LIMIT:
                break
        return found[:count][::-1]

    async def run_records(self, run_id: str) -> list[dict[str, Any]]:
        """Every record of the run, in the order they were written."""
        records: list[dict[str, Any]] = []
        seen: set[str] = set()
        low = "-"
        while True:
            async with redis_call("read run", self._timeout):
                entries = _entries(
                    await self._client.xrange(run_lineage_key(run_id), low, "+", count=PAGE)
                )
            records.extend(_records(entries, seen))
            if len(entries) < PAGE:
                return records
            low = "(" + text(entries[-1][0])

    async def generations(
        self, replica: str | None = None, count: int = 100
    ) -> list[dict[str, Any]]:
        """The newest ``count`` generation changes (of one replica, if given), newest last."""
        found: list[dict[str, Any]] = []
        async for entries in self._pages_backwards(GENERATIONS):
            for entry_id, fields in entries:
                event: dict[str, Any] = {text(k): text(v) for k, v in fields.items()}
                if replica is None or event.get("replica") == replica:
                    event["generation"] = int(event.get("generation", 0))
                    found.append({"id": text(entry_id), **event})
            if len(found) >= count:
                break
        return found[:count][::-1]

    async def heads(self, replica_ids: Iterable[str]) -> dict[str, ChainHead | None]:
        ids = list(replica_ids)
        pipe = self._client.pipeline(transaction=False)
        for replica in ids:
            pipe.hmget(cache_key(replica), list(HEAD_FIELDS))
        async with redis_call("read heads", self._timeout):
            replies: list[Sequence[Any]] = await pipe.execute()
        return {
            replica: head_from(replica, values)
            for replica, values in zip(ids, replies, strict=True)
        }

    async def _pages_backwards(self, stream: str) -> AsyncIterator[list[Entry]]:
        high = "+"
        while True:
            async with redis_call("read " + stream, self._timeout):
                entries = _entries(await self._client.xrevrange(stream, high, "-", count=PAGE))
            if entries:
                yield entries
            if len(entries) < PAGE:
                return
            high = "(" + text(entries[-1][0])


def _entries(reply: Any) -> list[Entry]:
    return list(reply or [])


def _records(entries: Iterable[Entry], seen: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _entry_id, fields in entries:
        record = entry_record(fields)
        if record is None:
            continue
        request_id = str(record.get("request_id"))
        if request_id not in seen:
            seen.add(request_id)
            out.append(record)
    return out
