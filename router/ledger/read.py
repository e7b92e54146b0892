"""Reading the ledger back: one record, the tail of the lineage, a run, generations, heads.

The records of truth are the replicas' lineage streams (one per replica, in chain order); the
tail merges them by stream id, which is Redis' clock, so the merge is in the order Redis wrote
them. A run's records come from its index stream, which may hold a record twice (an index write
repeated after a lost reply); request ids are unique, so readers keep the first copy of each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from router.ledger.chain import ChainHead
from router.ledger.errors import redis_call
from router.ledger.schema import (
    GENERATIONS,
    HEAD_FIELDS,
    REPLICAS,
    cache_key,
    entry_record,
    head_from,
    replica_lineage_key,
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
        """One record by request id: its key lives in its replica's hash tag, so every
        registered replica is asked (one pipelined round trip)."""
        replicas = await self.replica_ids()
        pipe = self._client.pipeline(transaction=False)
        for replica in replicas:
            pipe.get(request_key(replica, request_id))
        async with redis_call("get record", self._timeout):
            found = [raw for raw in await pipe.execute() if raw is not None]
        if not found:
            return None
        # A request written to one replica that failed without an answer, then served by
        # another, has a record on each: the latest (the one its client got) is the answer.
        records: list[dict[str, Any]] = [orjson.loads(raw) for raw in found]
        return max(records, key=lambda r: str(r.get("at") or ""))

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
        replicas = [replica] if replica is not None else await self.replica_ids()
        entries: list[Entry] = []
        for rid in replicas:
            entries.extend(await self._newest(replica_lineage_key(rid), count, wanted))
        entries.sort(key=lambda e: _stream_id(e[0]))
        return _records(entries[-count:], set())

    async def replica_ids(self) -> list[str]:
        """Every replica a proxy registered (their streams hold the lineage)."""
        async with redis_call("read replicas", self._timeout):
            return sorted(text(k) for k in await self._client.hkeys(REPLICAS))

    async def replica_records(self, replica: str, after: str = "-") -> AsyncIterator[list[Entry]]:
        """The replica's stream in chain order, a page at a time, after stream id ``after``."""
        low = after
        while True:
            async with redis_call("read lineage", self._timeout):
                page = _entries(
                    await self._client.xrange(replica_lineage_key(replica), low, "+", count=PAGE)
                )
            if page:
                yield page
            if len(page) < PAGE:
                return
            low = "(" + text(page[-1][0])

    async def _newest(
        self, stream: str, count: int, wanted: Callable[[dict[str, Any]], bool]
    ) -> list[Entry]:
        """Up to ``count`` newest entries of ``stream`` whose record is wanted, oldest first."""
        found: list[Entry] = []
        scanned = 0
        async for entries in self._pages_backwards(stream):
            scanned += len(entries)
            for entry in entries:
                record = entry_record(entry[1])
                if record is not None and wanted(record):
                    found.append(entry)
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

    async def generation_records(
        self, replica: str, generation: int, upto_seq: int
    ) -> list[dict[str, Any]]:
        """The replica's records of ``generation`` with seq below ``upto_seq``, in chain order
        (the history a request of that generation at ``upto_seq`` was served on)."""
        after = "-"
        for event in await self.generations(replica, count=100_000):
            if event["generation"] == generation:
                after = f"{max(0, _stream_id(event['id'])[0] - 60_000)}-0"
        found: dict[int, dict[str, Any]] = {}
        async for entries in self.replica_records(replica, after):
            for record in _records(entries, set()):
                gen, seq = record.get("generation"), record.get("seq")
                if gen == generation and seq is not None and seq < upto_seq:
                    found.setdefault(int(seq), record)
            if len(found) >= upto_seq:
                break
        return [found[seq] for seq in sorted(found)]

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


def _stream_id(entry_id: Any) -> tuple[int, int]:
    ms, _, seq = text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _entries(reply: Any) -> list[Entry]:
    return list(reply or [])


def _records(entries: Iterable[Entry], seen: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _entry_id, fields in entries:
        record = entry_record(fields)
        if record is None:
            continue
        # A request that failed with its replica and was retried after its run moved has a
        # record on each replica (``router.eval.failover``): both are kept.
        request_id = f"{record.get('request_id')}@{record.get('replica')}"
        if request_id not in seen:
            seen.add(request_id)
            out.append(record)
    return out
