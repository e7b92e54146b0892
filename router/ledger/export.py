"""Reading records out a page at a time (the /ui/ page) and in bulk (``kvledger export``).

A run's records come from its index stream (``kvl:{run:ID}:lineage``), read with ``XRANGE`` /
``XREVRANGE`` and a ``COUNT``, so a page of a run of 100,000 requests costs one round trip of
one page, never the whole run. A time window without a run reads the replicas' streams, whose
ids are Redis' clock in milliseconds, so ``--since/--until`` become stream id bounds. The
prompt and output of an eval request come from the run's requests stream, where the eval
dispatcher keeps them (``router.eval.dispatch``); production requests keep neither.

``COLUMNS`` is the export's schema: one row a request, each record field a typed column, any
field not listed kept as JSON text in ``extra`` so that nothing is lost.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import redis.asyncio as aioredis

from router.ledger.errors import redis_call
from router.ledger.read import LedgerReader
from router.ledger.runs import RunStore, requests_key
from router.ledger.schema import entry_record, replica_lineage_key, run_lineage_key, text

PAGE = 1000
STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")
# How far (ms) before a record's index entry the run's requests stream is searched for its input.
INPUT_WINDOW_MS = 10_000
# A record's stream entry is written after its ``at`` (a request's length, a spool's wait).
WINDOW_SLACK_MS = 600_000

STRING = "string"
INT = "int64"
FLOAT = "float64"
BOOL = "bool"
TIME = "timestamp[ms, UTC]"
# The export's columns, in order, with their types (docs/ui.md lists them with their meaning).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("request_id", STRING),
    ("at", TIME),
    ("key", STRING),
    ("mode", STRING),
    ("arm", STRING),
    ("run", STRING),
    ("episode", STRING),
    ("replica", STRING),
    ("model", STRING),
    ("engine_digest", STRING),
    ("generation", INT),
    ("seq", INT),
    ("state_before", STRING),
    ("state_after", STRING),
    ("state_known", BOOL),
    ("stale", BOOL),
    ("unordered", BOOL),
    ("exact", BOOL),
    ("verified", BOOL),
    ("durable", BOOL),
    ("pending", BOOL),
    ("warning", STRING),
    ("digest", STRING),
    ("prompt_digest", STRING),
    ("params_digest", STRING),
    ("output_digest", STRING),
    ("reused_blocks", INT),
    ("total_blocks", INT),
    ("new_blocks", INT),
    ("cached_tokens", INT),
    ("prompt_tokens", INT),
    ("completion_tokens", INT),
    ("status", STRING),
    ("latency_ms", FLOAT),
    ("ttft_ms", FLOAT),
    ("policy", STRING),
    ("reason", STRING),
    ("extra", STRING),
    ("prompt", STRING),
    ("output", STRING),
)
TYPED = {name for name, _ in COLUMNS} - {"extra", "prompt", "output"}

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Page:
    """Records of one run in stream order, each with its index entry id, and the ids a page
    before (``newer``) and after it would start from."""

    entries: list[tuple[str, Record]]
    older: str | None
    newer: str | None


def ms_of(entry_id: str) -> int:
    return int(entry_id.partition("-")[0])


def at_ms(value: Any) -> int | None:
    """A record's ``at`` (ISO 8601) in milliseconds since the epoch, None when absent or odd."""
    if not isinstance(value, str):
        return None
    try:
        return round(datetime.fromisoformat(value).timestamp() * 1000)
    except ValueError:
        return None


class RecordPages:
    """The reads of the /ui/ page and the export."""

    def __init__(self, client: aioredis.Redis, timeout_s: float = 5.0) -> None:
        self._client = client
        self._timeout = timeout_s
        self.reader = LedgerReader(client, timeout_s)
        self.store = RunStore(client, timeout_s)

    async def run_length(self, run: str) -> int:
        async with redis_call("count run records", self._timeout):
            return int(await self._client.xlen(run_lineage_key(run)))

    async def run_page(
        self, run: str, count: int, *, after: str | None = None, before: str | None = None
    ) -> Page:
        """``count`` records of the run after entry ``after`` (from the start when neither is
        given), or the ``count`` before ``before``; oldest first either way."""
        key = run_lineage_key(run)
        async with redis_call("read run page", self._timeout):
            if before is not None:
                raw = await self._client.xrevrange(key, "(" + before, "-", count=count + 1)
                raw = list(raw or [])[::-1]
                more_before = len(raw) > count
                raw = raw[1:] if more_before else raw
                more_after = True
            else:
                low = "-" if after is None else "(" + after
                raw = list(await self._client.xrange(key, low, "+", count=count + 1) or [])
                more_after = len(raw) > count
                raw = raw[:count]
                more_before = after is not None
        entries = [(text(i), r) for i, f in raw if (r := entry_record(f or {})) is not None]
        ids = [text(i) for i, _ in raw]
        return Page(
            entries,
            older=ids[0] if ids and more_before else None,
            newer=ids[-1] if ids and more_after else None,
        )

    async def run_entry(self, run: str, entry_id: str) -> Record | None:
        async with redis_call("read run entry", self._timeout):
            raw = list(
                await self._client.xrange(run_lineage_key(run), entry_id, entry_id, count=1) or []
            )
        return entry_record(raw[0][1] or {}) if raw else None

    async def find_input(self, run: str, request_id: str, near: str) -> Record | None:
        """The run's kept input (and output) of ``request_id``, searched from a little before
        its index entry ``near`` (the input is written just after the record)."""
        low = f"{max(0, ms_of(near) - INPUT_WINDOW_MS)}-0"
        for _ in range(20):
            async with redis_call("read run input", self._timeout):
                raw = list(await self._client.xrange(requests_key(run), low, "+", count=200) or [])
            for _id, fields in raw:
                entry = _entry(fields)
                if entry is not None and entry.get("request_id") == request_id:
                    return entry
            if len(raw) < 200:
                return None
            low = "(" + text(raw[-1][0])
        return None

    async def inputs(self, run: str) -> dict[str, Record]:
        """Every kept input of the run, by request id."""
        return {str(e.get("request_id")): e for e in await self.store.requests(run)}

    async def runs_of(self, arm: str) -> list[str]:
        """The arm's runs, oldest first."""
        runs = await self.store.recent(100_000)
        return [r["id"] for r in reversed(runs) if r.get("arm") == arm and "id" in r]

    async def run_records(self, run: str) -> AsyncIterator[list[Record]]:
        """The run's records a page at a time, oldest first, each request once."""
        seen: set[str] = set()
        low = "-"
        while True:
            async with redis_call("read run", self._timeout):
                raw = list(
                    await self._client.xrange(run_lineage_key(run), low, "+", count=PAGE) or []
                )
            page = [r for _i, f in raw if (r := entry_record(f or {})) is not None]
            fresh = [r for r in page if str(r.get("request_id")) not in seen]
            seen.update(str(r.get("request_id")) for r in fresh)
            if fresh:
                yield fresh
            if len(raw) < PAGE:
                return
            low = "(" + text(raw[-1][0])

    async def window(self, since_ms: int, until_ms: int) -> AsyncIterator[list[Record]]:
        """Every replica's records whose ``at`` is in [since, until], in Redis' order. A record
        is stamped before its stream entry is written, so the ids are read with a margin."""
        low_ms, high_ms = max(0, since_ms - WINDOW_SLACK_MS), until_ms + WINDOW_SLACK_MS
        found: list[tuple[tuple[int, int], Record]] = []
        for replica in await self.reader.replica_ids():
            low = f"{low_ms}-0"
            while True:
                async with redis_call("read lineage", self._timeout):
                    raw = list(
                        await self._client.xrange(
                            replica_lineage_key(replica), low, str(high_ms), count=PAGE
                        )
                        or []
                    )
                for entry_id, fields in raw:
                    record = entry_record(fields or {})
                    at = None if record is None else at_ms(record.get("at"))
                    if record is not None and at is not None and since_ms <= at <= until_ms:
                        ms, _, n = text(entry_id).partition("-")
                        found.append(((int(ms), int(n or 0)), record))
                if len(raw) < PAGE:
                    break
                low = "(" + text(raw[-1][0])
        found.sort(key=lambda pair: pair[0])
        for i in range(0, len(found), PAGE):
            yield [record for _, record in found[i : i + PAGE]]


def _entry(fields: Any) -> Record | None:
    raw = (fields or {}).get(b"e") or (fields or {}).get("e")
    if raw is None:
        return None
    found: Record = orjson.loads(raw)
    return found


def columns(records: list[Record], kept: list[Record | None]) -> dict[str, list[Any]]:
    """The records as the export's columns, values as the records hold them (``coerce`` makes
    them fit a column's type where a record holds something else); ``extra`` holds, as JSON,
    any field without a column of its own, and ``prompt`` and ``output`` the kept input."""
    out: dict[str, list[Any]] = {name: [r.get(name) for r in records] for name in TYPED}
    out["extra"] = [_extra(r) for r in records]
    out["prompt"] = [None if k is None else k.get("prompt") for k in kept]
    out["output"] = [None if k is None else k.get("output") for k in kept]
    return out


def _extra(record: Record) -> str | None:
    names = record.keys() - TYPED  # a set operation in C: most records have no extra field
    if not names:
        return None
    return orjson.dumps({k: record[k] for k in names}, option=orjson.OPT_SORT_KEYS).decode()


def coerce(values: list[Any], kind: str) -> list[Any]:
    """``values`` made to fit a column of ``kind`` (``at`` to epoch ms; odd values to None or
    their JSON text): the slow path, for a batch the fast conversion refused."""
    out: list[Any] = []
    for value in values:
        try:
            if kind == TIME:
                value = at_ms(value)
            elif value is not None and kind == INT:
                value = int(value)
            elif value is not None and kind == FLOAT:
                value = float(value)
            elif value is not None and kind == BOOL:
                value = bool(value)
            elif value is not None and kind == STRING and not isinstance(value, str):
                value = orjson.dumps(value).decode()
        except (TypeError, ValueError):
            value = None
        out.append(value)
    return out
