"""The ledger: cache generations, state chains and lineage records in Redis (DESIGN.md §5).

A replica's chain lives in one hash, ``kvl:{replica:ID}:cache``, and moves by one Lua call per
request that also writes the request's lineage record into the replica's stream
(``router.ledger.scripts``): one round trip, exactly once. While Redis is away, the record is
answered ``pending`` and its step waits in a bounded buffer and a local spool; late steps run
in spool order once Redis is back (``router.ledger.writer``).

Errors (``router.ledger.errors``, re-exported by the package)::

    LedgerError                 the ledger cannot do what was asked
     ├── LedgerUnavailable      Redis did not answer within redis_timeout_s, or refused
     ├── UnknownReplica         the replica has no chain in Redis yet (call ensure_replica)
     └── SpoolUnavailable       start(): the spool cannot be opened, or another process holds it

The parts: ``chain`` (fingerprints, pure), ``schema`` (every key name and stream field),
``scripts`` (the Lua), ``records`` (what a record holds), ``writer`` and ``spool`` (the way to
Redis), ``read``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.commands.core import AsyncScript
from redis.typing import EncodableT

from router.ledger.audit import Auditor, ChainAudit
from router.ledger.chain import Advance, ChainHead, genesis
from router.ledger.cluster_wire import ClusterWire
from router.ledger.connect import is_cluster
from router.ledger.epoch import LOST_REASON, Epoch, EpochLoss
from router.ledger.errors import (
    REDIS_FAILURES,
    LedgerUnavailable,
    SpoolUnavailable,
    UnknownReplica,
    redis_call,
    unavailable,
)
from router.ledger.persistence import WARNING, redis_persistence
from router.ledger.read import LedgerReader
from router.ledger.records import CHAIN_FIELDS, chain_fields, stamp, template, with_chain
from router.ledger.schema import (
    GENERATIONS,
    GENERATIONS_MAXLEN,
    HEAD_FIELDS,
    advance_from,
    cache_key,
    entry_record,
    generation_fields,
    head_from,
    replica_key,
    step_keys,
    text,
)
from router.ledger.scripts import Scripts
from router.ledger.spool import Step, job_from_record
from router.ledger.wire import Wire
from router.ledger.writer import LedgerConfig, Writer

Record = dict[str, Any]


class Fence:
    """An eval request's hold on its replica: the turn's token, the run, and the replica's
    request counter after the request (stored for the run's next continuity check)."""

    def __init__(self, token: str, run: str, count: int) -> None:
        self.token, self.run, self.count = token, run, count


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
        # The chain step's own connection(s) (see ``wire`` and ``cluster_wire``).
        self._wire: Wire | ClusterWire | None = (
            ClusterWire.like(client) if is_cluster(client) else Wire.like(client)
        )
        self._durable = Durability(client, self._wire)
        self.epoch = Epoch(client)
        self.persistence = "unknown"  # what Redis does to keep its data: see ``persistence``
        self._writer = Writer(
            client, self._scripts, config, log, self._ensure_unknown, self._writer_epoch
        )
        self._reader = LedgerReader(client, config.redis_timeout_s)

    async def start(self) -> None:
        """Open the spool (a previous process's records are drained first) and start writing."""
        if self._cfg.durable_wait_ms > 0 or self._cfg.production_wait_ms > 0:
            await self._durable.check(min(2.0, self._cfg.redis_timeout_s * 2))
        try:
            await self._writer.start()
        except OSError as exc:
            raise SpoolUnavailable(f"spool {self._cfg.spool_path}: {exc}") from exc
        self.persistence = await redis_persistence(self._client)
        if self.persistence == "none":
            self._log.warning("redis_without_persistence", persistence="none", warning=WARNING)

    async def close(self) -> None:
        """Write what Redis takes within ``close_timeout_s``; the rest stays in the spool."""
        await self._writer.close()
        self._durable.close()
        if self._wire is not None:
            self._wire.close()

    @property
    def redis_up(self) -> bool:
        """True when a chain step can run now: Redis answers and no late step waits to go first
        (so steps keep submit order). False: :meth:`commit` defers the step."""
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
            "epoch_lost_total": self.epoch.losses,
        }

    # The epoch -----------------------------------------------------------------------------

    async def check_epoch(self) -> EpochLoss | None:
        """Compare the ledger epoch in Redis with the one this proxy remembers (see ``epoch``);
        a loss is logged (``ledger_epoch_lost``, an error) and counted, and returned. Raises
        LedgerUnavailable when Redis does not answer. Not for the request path."""
        loss = await self.epoch.check()
        if loss is not None:
            self._writer.epoch = loss.current.id
            self._log.error(
                "ledger_epoch_lost",
                reason=LOST_REASON,
                lost_epoch=loss.lost.id,
                lost_created_at=loss.lost.created_at,
                last_seen_at=loss.seen_at,
                epoch=loss.current.id,
                history_starts=loss.current.created_at,
            )
        return loss

    async def _writer_epoch(self) -> str | None:
        await self.check_epoch()
        return self.epoch.id

    # Generations ---------------------------------------------------------------------------

    async def ensure_replica(
        self, replica_id: str, engine_digest: str, *, proven_empty: bool, counter: int
    ) -> ChainHead:
        """The replica's head, starting a generation when its chain is absent, its engine digest
        changed, or its request counter is below the generation's start (see ``scripts``). A new
        generation's state is genesis only if ``proven_empty``, else unknown."""
        args: list[EncodableT] = [
            engine_digest,
            genesis(engine_digest),
            stamp(),
            int(proven_empty),
            counter,
        ]
        async with self._call("ensure replica"):
            raw = await self._scripts.ensure(keys=[cache_key(replica_id)], args=args)
        head = _head(replica_id, raw)
        if text(raw[5]):
            await self._log_generation(head, text(raw[5]))
        return head

    async def new_generation(
        self,
        replica_id: str,
        engine_digest: str,
        reason: str,
        details: Mapping[str, str] | None = None,
        *,
        proven_empty: bool,
        counter: int = 0,
    ) -> ChainHead:
        """Its cache started anew: generation + 1, seq 0, genesis if proven empty, else an
        unknown state."""
        args: list[EncodableT] = [
            engine_digest,
            genesis(engine_digest),
            stamp(),
            reason,
            int(proven_empty),
            counter,
        ]
        async with self._call("new generation"):
            raw = await self._scripts.new_generation(keys=[cache_key(replica_id)], args=args)
        head = _head(replica_id, raw)
        await self._log_generation(head, reason, details)
        return head

    async def head(self, replica_id: str) -> ChainHead:
        async with self._call("read head"):
            values = await self._client.hmget(cache_key(replica_id), list(HEAD_FIELDS))
        head = head_from(replica_id, values)
        if head is None:
            raise UnknownReplica(f"replica {replica_id!r} has no chain; call ensure_replica")
        return head

    async def heads(self, replica_ids: Iterable[str]) -> dict[str, ChainHead | None]:
        return await self._reader.heads(replica_ids)

    # Chain steps ---------------------------------------------------------------------------

    async def commit(self, record: Record, *, exact: bool = False) -> Record:
        """Step the replica's chain by this request and write its record: one Redis call.

        Returns the record as stored. While Redis is away (or late steps wait to go first),
        the record is returned ``pending`` with empty chain fields, and its step is spooled.
        Cancelled (its client left) while the step was on its way, the step is queued as if
        Redis had not answered: it may have run, and its retry runs it at most once (the step
        key). So a caller need not shield this call to keep the record.
        """
        if not self.redis_up:
            return self.defer(record, exact, tried=False)
        try:
            return await self._step(record, exact, None)
        except LedgerUnavailable:
            return self.defer(record, exact, tried=True)
        except asyncio.CancelledError:
            if "seq" not in record:  # not stepped yet: the writer steps it
                self.defer(record, exact, tried=True)
            raise

    async def fenced_commit(self, record: Record, fence: Fence, *, exact: bool = True) -> Record:
        """The eval chain step, under the run's turn (``unordered`` when the turn was lost).
        LedgerUnavailable when Redis failed: the caller defers it and the run is broken."""
        return await self._step(record, exact, fence)

    async def lost(self, record: Record, reason: str) -> Record:
        """A request written to its replica that failed without an answer: the replica may
        have run it (a cache touch no other record mentions), so its state is unknown from
        here. The record (its status ``error``, ``reason`` its warning) steps the chain to a
        fresh unknown state and says so (``unordered: true``, ``exact: false``): one Redis
        call, as :meth:`commit`; deferred (and then run the same way) while Redis is away."""
        record["warning"] = reason
        if not self.redis_up:
            return self.defer(record, False, tried=True, uncertain=True)
        try:
            return await self._step(record, False, None, uncertain=True)
        except LedgerUnavailable:
            return self.defer(record, False, tried=True, uncertain=True)

    def defer(self, record: Record, exact: bool, *, tried: bool, uncertain: bool = False) -> Record:
        """Answer ``record`` pending and queue its step, in submit order; ``tried`` says the
        step was sent and may have run (its retry then relies on the step key and the record
        key); ``uncertain``: the request may have run unrecorded at any time, so its step moves
        the chain to an unknown state (``tried_ms`` 0: see ``Writer._pipeline_steps``)."""
        # Nothing is known of its step yet: no chain fields, and not exact.
        fields = dict.fromkeys(CHAIN_FIELDS)
        record.update(fields, pending=True, stale=False, unordered=False, exact=False)
        step = Step(
            str(record["replica"]),
            int(record["generation"]),
            str(record["digest"]),
            exact,
            0 if uncertain else int(time.time() * 1000) if tried else None,
            self.epoch.id,
        )
        self._writer.put(job_from_record(record, template(record), step))
        return record

    async def _step(
        self, record: Record, exact: bool, fence: Fence | None, *, uncertain: bool = False
    ) -> Record:
        data = template(record)
        replica, request_id = str(record["replica"]), str(record["request_id"])
        keys = step_keys(replica, request_id)
        args: list[EncodableT] = [
            record["generation"],
            record["digest"],
            data,
            self._cfg.step_ttl_s,
            self._cfg.lineage_maxlen,
            int(exact),
            request_id,
            self._cfg.request_ttl_s,
        ]
        script = self._scripts.step
        if fence is not None:
            keys += [replica_key(replica, "turn"), replica_key(replica, "run")]
            args += [fence.token, fence.run, fence.count]
            script = self._scripts.fenced_step
        elif uncertain:
            script = self._scripts.uncertain_step
        wait_ms = self._wait_ms(keys[0], eval_step=fence is not None)
        raw, acked = await self._run_waiting(script, keys, args, wait_ms)
        step = advance_from(replica, raw)
        if step is None:  # Redis lost the chain: start an unknown one, then step (stale)
            await self._ensure_unknown(replica, str(record["engine_digest"]))
            earlier = record.get("warning")
            record["warning"] = LOST_REASON if not earlier else f"{LOST_REASON}; {earlier}"
            data = args[2] = template(record)
            raw, acked = await self._run_waiting(script, keys, args, wait_ms)
            step = advance_from(replica, raw)
        if step is None:
            raise UnknownReplica(f"replica {replica!r} has no chain")
        fields = chain_fields(step, exact)
        record.update(fields)
        entry = with_chain(data, fields)
        if wait_ms:  # the stream's copy was written before the WAIT: only the answer says it
            record["durable"] = acked > 0
            entry = entry[:-1] + (b',"durable":true}' if acked > 0 else b',"durable":false}')
        if record.get("run") is not None:
            self._writer.index(request_id, record["run"], entry)
        return record

    def _wait_ms(self, key: str, *, eval_step: bool) -> int:
        """How long the step's ``WAIT`` may take: 0 (no WAIT) unless the setting asks for one
        (``durable_wait_ms`` for eval steps, ``production_wait_ms`` for the others) and the
        master of ``key`` has a replica to acknowledge it (see :class:`Durability`)."""
        wait_ms = self._cfg.durable_wait_ms if eval_step else self._cfg.production_wait_ms
        if wait_ms <= 0 or not self._durable.replicated(key):
            return 0
        return wait_ms

    async def _run_waiting(
        self, script: AsyncScript, keys: list[str], args: list[EncodableT], wait_ms: int
    ) -> tuple[Any, int]:
        """:meth:`_run`, then (``wait_ms`` > 0) ``WAIT 1 wait_ms`` on the same connection:
        the reply and the replicas that acknowledged the step (-1: no WAIT asked)."""
        if not wait_ms:
            return await self._run(script, keys, args), -1
        timeout_s = self._cfg.redis_timeout_s + wait_ms / 1000
        try:
            if self._wire is not None:
                return await self._wire.script_wait(script, keys, args, timeout_s, wait_ms)
            async with asyncio.timeout(timeout_s):
                pipe = self._client.pipeline(transaction=False)  # one connection: WAIT counts it
                await script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", 1, wait_ms)
                reply, acked = await pipe.execute()
                return reply, int(acked)
        except REDIS_FAILURES as exc:
            error = unavailable("chain step", exc)
            self._writer.went_down(error)
            raise error from exc

    async def _run(self, script: AsyncScript, keys: list[str], args: list[EncodableT]) -> Any:
        """The request path's one Redis call, on the wire when there is one, within
        ``redis_timeout_s``; as :meth:`_call`, a failure tells the writer Redis is away.
        (Not :meth:`_call` itself: its context manager and timeout cost more than the wire's
        timer, on every request.)"""
        timeout_s = self._cfg.redis_timeout_s
        try:
            if self._wire is not None:
                return await self._wire.script(script, keys, args, timeout_s)
            async with asyncio.timeout(timeout_s):
                return await script(keys=keys, args=args)
        except REDIS_FAILURES as exc:
            error = unavailable("chain step", exc)
            self._writer.went_down(error)
            raise error from exc

    async def _ensure_unknown(self, replica: str, engine_digest: str) -> int:
        """A chain for a replica whose chain Redis lost: nothing proves its cache empty.
        Answers its generation."""
        head = await self.ensure_replica(replica, engine_digest, proven_empty=False, counter=0)
        return head.generation

    # Reading --------------------------------------------------------------------------------

    async def record(self, request_id: str) -> Record | None:
        return await self._reader.record(request_id)

    async def tail(
        self,
        count: int = 50,
        replica: str | None = None,
        key: str | None = None,
        run: str | None = None,
    ) -> list[Record]:
        return await self._reader.tail(count, replica=replica, key=key, run=run)

    async def run_records(self, run_id: str) -> list[Record]:
        return await self._reader.run_records(run_id)

    async def generations(self, replica: str | None = None, count: int = 100) -> list[Record]:
        return await self._reader.generations(replica, count)

    async def generation_records(self, replica: str, generation: int, upto: int) -> list[Record]:
        return await self._reader.generation_records(replica, generation, upto)

    async def audit(self, replicas: Iterable[str] | None = None) -> list[ChainAudit]:
        """Walk each replica's stream and check its chain (``router.ledger.audit``)."""
        ids = list(replicas) if replicas is not None else await self._reader.replica_ids()
        audits = []
        for replica in ids:
            auditor = Auditor(replica)
            async for page in self._reader.replica_records(replica):
                for _entry_id, fields in page:
                    record = entry_record(fields)
                    if record is not None:
                        auditor.feed(record)
            audits.append(auditor.done())
        return audits

    async def _log_generation(
        self, head: ChainHead, reason: str, details: Mapping[str, str] | None = None
    ) -> None:
        fields = generation_fields(
            head.replica, head.generation, reason, head.engine_digest, stamp(), details
        )
        fields["known"] = int(head.known)
        async with self._call("log generation"):
            await self._client.xadd(
                GENERATIONS, fields, maxlen=GENERATIONS_MAXLEN, approximate=True
            )
        self._log.info(
            "ledger_generation_started",
            replica=head.replica,
            generation=head.generation,
            known=head.known,
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


class Durability:
    """Whether a step's master has a replica that a ``WAIT`` can count on. On a cluster, the
    slot map says (a replica listed for the slot); on one node, ``INFO replication``
    (``connected_slaves``). Either is read at start and again every ``CHECK_EVERY_S`` in the
    background (a replica added, or lost, is seen within that).
    Without a replica no ``WAIT`` is sent (it could only time out) and records carry no
    ``durable`` field: durability was not asked of a Redis that cannot give it. Once seen, a
    replica is expected for as long as this process runs: its loss shows as ``durable: false``
    (the WAIT times out), never as records that silently stop asking."""

    CHECK_EVERY_S = 10.0

    def __init__(self, client: aioredis.Redis, wire: Wire | ClusterWire | None) -> None:
        self._client, self._wire = client, wire
        self._single = False
        self._checked_at = -1e9
        self._checking: asyncio.Task[None] | None = None

    def replicated(self, key: str) -> bool:
        if time.monotonic() - self._checked_at > self.CHECK_EVERY_S and (
            self._checking is None or self._checking.done()
        ):
            self._checking = asyncio.ensure_future(self.check())
        if isinstance(self._wire, ClusterWire):
            return self._wire.replicated(key)
        return self._single

    async def check(self, timeout_s: float = 2.0) -> None:
        """Read whether the Redis has a replica now (never raises: unknown keeps the last)."""
        self._checked_at = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                if isinstance(self._wire, ClusterWire):
                    await self._wire.refresh()
                    return
                info = await self._client.info("replication")
            self._single = self._single or int(info.get("connected_slaves", 0) or 0) > 0
        except REDIS_FAILURES:
            return

    def close(self) -> None:
        if self._checking is not None:
            self._checking.cancel()


def _head(replica_id: str, raw: list[Any]) -> ChainHead:
    """A head from ENSURE's or NEW_GENERATION's answer (generation, seq, state, digest, known)."""
    head = head_from(replica_id, raw)
    assert head is not None  # both scripts always answer a head
    return head


__all__ = ["Advance", "Fence", "Ledger"]
