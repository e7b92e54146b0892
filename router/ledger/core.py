"""The ledger: cache generations, state chains and lineage records in Redis (DESIGN.md §5).

A replica's chain lives in one hash, ``kvl:{replica:ID}:cache``, and moves by one Lua script, so
proxy instances sharing a replica keep one chain. Lineage records are written behind the
response by a background writer; while Redis is away they wait in a bounded buffer and a local
spool, and late chain steps run in spool order once it is back (``router.ledger.writer``).

Errors (``router.ledger.errors``, re-exported here)::

    LedgerError                 the ledger cannot do what was asked
     ├── LedgerUnavailable      Redis did not answer within redis_timeout_s, or refused
     ├── UnknownReplica         the replica has no chain in Redis yet (call ensure_replica)
     └── SpoolUnavailable       start(): the spool cannot be opened, or another process holds it

The parts: ``chain`` (fingerprints, pure), ``schema`` (every key name, stream field and
script), ``writer`` and ``spool`` (the way to Redis), ``read``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
import redis.asyncio as aioredis
import structlog
from redis.typing import EncodableT

from router.ledger.chain import Advance, ChainHead, genesis
from router.ledger.errors import (
    LedgerUnavailable,
    SpoolUnavailable,
    UnknownReplica,
    redis_call,
)
from router.ledger.read import LedgerReader
from router.ledger.schema import (
    GENERATIONS,
    GENERATIONS_MAXLEN,
    HEAD_FIELDS,
    Scripts,
    advance_from,
    cache_key,
    generation_fields,
    head_from,
    step_key,
    text,
)
from router.ledger.spool import Step, job_from_record
from router.ledger.writer import LedgerConfig, Writer


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class Ledger:
    def __init__(
        self,
        client: aioredis.Redis,
        config: LedgerConfig,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self._client = client
        self._cfg = config
        self._log = log
        self._scripts = Scripts(client)
        self._writer = Writer(client, self._scripts, config, log)
        self._reader = LedgerReader(client, config.redis_timeout_s)

    async def start(self) -> None:
        """Open the spool (a previous process's records are drained first) and start writing."""
        try:
            await self._writer.start()
        except OSError as exc:
            raise SpoolUnavailable(f"spool {self._cfg.spool_path}: {exc}") from exc

    async def close(self) -> None:
        """Write what Redis takes within ``close_timeout_s``; the rest stays in the spool."""
        await self._writer.close()

    @property
    def redis_up(self) -> bool:
        """True when a chain step can run now: Redis answers and no late step waits to go first
        (so steps keep submit order). False sends callers to :meth:`submit_pending`."""
        w = self._writer
        return w.redis_up and not w.spool.pending and w.steps_in_buffer == 0

    def stats(self) -> dict[str, Any]:
        w = self._writer
        return {
            "buffer_depth": len(w.buffer),
            "spooled": w.spool.count,
            "spooled_total": w.spooled_total,
            "written_total": w.written_total,
            "dropped_total": w.dropped_total,
            "redis_up": w.redis_up,
        }

    async def ensure_replica(self, replica_id: str, engine_digest: str) -> ChainHead:
        """The replica's head, creating its chain (generation 1) if absent; a different engine
        digest starts a new generation ("engine changed")."""
        args = [engine_digest, genesis(engine_digest), _now()]
        async with self._call("ensure replica"):
            raw = await self._scripts.ensure(keys=[cache_key(replica_id)], args=args)
        head = _known(replica_id, head_from(replica_id, raw))
        reason = text(raw[4])
        if reason:
            await self._log_generation(head, reason)
        return head

    async def new_generation(
        self,
        replica_id: str,
        engine_digest: str,
        reason: str,
        details: Mapping[str, str] | None = None,
    ) -> ChainHead:
        """Its cache is known to be empty: generation + 1, seq 0, state genesis."""
        state = genesis(engine_digest)
        args = [engine_digest, state, _now(), reason]
        async with self._call("new generation"):
            raw = await self._scripts.new_generation(keys=[cache_key(replica_id)], args=args)
        head = ChainHead(replica_id, int(raw), 0, state, engine_digest)
        await self._log_generation(head, reason, details)
        return head

    async def head(self, replica_id: str) -> ChainHead:
        async with self._call("read head"):
            values = await self._client.hmget(cache_key(replica_id), list(HEAD_FIELDS))
        return _known(replica_id, head_from(replica_id, values))

    async def heads(self, replica_ids: Iterable[str]) -> dict[str, ChainHead | None]:
        return await self._reader.heads(replica_ids)

    async def advance(
        self, replica_id: str, generation: int, digest: str, *, request_id: str | None = None
    ) -> Advance:
        """Step the chain by ``digest`` if ``generation`` is current (else ``stale``, unmoved).

        With ``request_id`` the step is idempotent for ``step_ttl_s``: a retry (the reply was
        lost; the record then goes through :meth:`submit_pending`) gets the first answer
        instead of stepping twice. That costs one short-lived key per request.
        """
        keys = [cache_key(replica_id)]
        if request_id is not None:
            keys.append(step_key(replica_id, request_id))
        args: list[EncodableT] = [generation, digest, self._cfg.step_ttl_s]
        async with self._call("advance"):
            raw = await self._scripts.advance(keys=keys, args=args)
        step = advance_from(replica_id, raw)
        if step is None:
            raise UnknownReplica(f"replica {replica_id!r} has no chain")
        return step

    def submit(self, record: dict[str, Any]) -> None:
        """Queue a finished record (its chain already stepped). Never blocks, never raises."""
        self._enqueue(record, None)

    def submit_pending(self, record: dict[str, Any]) -> None:
        """Queue a record whose chain step is still due: it runs, in submit order, before the
        record is written, by the record's ``replica``, ``generation`` and ``digest``; the stored
        record keeps ``pending: true`` and gets ``seq``, ``state_before`` and ``state_after``."""
        try:
            step = Step(str(record["replica"]), int(record["generation"]), str(record["digest"]))
        except (KeyError, TypeError, ValueError):
            self._log.error("ledger_step_missing", request_id=record.get("request_id"))
            step = None
        self._enqueue({**record, "pending": True}, step)

    async def record(self, request_id: str) -> dict[str, Any] | None:
        return await self._reader.record(request_id)

    async def tail(
        self,
        count: int = 50,
        replica: str | None = None,
        key: str | None = None,
        run: str | None = None,
    ) -> list[dict[str, Any]]:
        return await self._reader.tail(count, replica=replica, key=key, run=run)

    async def run_records(self, run_id: str) -> list[dict[str, Any]]:
        return await self._reader.run_records(run_id)

    async def generations(
        self, replica: str | None = None, count: int = 100
    ) -> list[dict[str, Any]]:
        return await self._reader.generations(replica, count)

    def _enqueue(self, record: dict[str, Any], step: Step | None) -> None:
        try:
            data = orjson.dumps(record)
        except TypeError as exc:  # orjson.JSONEncodeError: a caller's bug, no disk can help
            self._writer.drop(str(record.get("request_id")), f"not serialisable: {exc}")
            return
        self._writer.put(job_from_record(record, data, step))

    async def _log_generation(
        self, head: ChainHead, reason: str, details: Mapping[str, str] | None = None
    ) -> None:
        fields = generation_fields(
            head.replica, head.generation, reason, head.engine_digest, _now(), details
        )
        async with self._call("log generation"):
            await self._client.xadd(
                GENERATIONS, fields, maxlen=GENERATIONS_MAXLEN, approximate=True
            )
        self._log.info(
            "ledger_generation_started",
            replica=head.replica,
            generation=head.generation,
            reason=reason,
        )

    @contextlib.asynccontextmanager
    async def _call(self, what: str) -> AsyncIterator[None]:
        """A chain operation: bounded, translated, and a failure tells the writer Redis is away."""
        try:
            async with redis_call(what, self._cfg.redis_timeout_s):
                yield
        except LedgerUnavailable as exc:
            self._writer.went_down(exc)
            raise


def _known(replica_id: str, head: ChainHead | None) -> ChainHead:
    if head is None:
        raise UnknownReplica(f"replica {replica_id!r} has no chain; call ensure_replica first")
    return head
