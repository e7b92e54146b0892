"""The background writer: late chain steps and record indexes go to Redis in batches, or to the
spool until it is back.

Two kinds of job: a *step* job (a request whose chain step could not run when it ended: it
runs here, and the step script writes its record into the replica's stream) and an *index* job
(an eval record's entry in its run's stream: a write that may be repeated, since readers drop
duplicates by request id).

Order: every job is submitted to the tail of one in-memory buffer. The writer moves jobs from
its head, either to Redis or to the end of the spool, so every line in the spool is older than
every job in the buffer, and draining the spool before the buffer keeps global submit order
(late chain steps included). A batch taken from the buffer stays in it until Redis has
acknowledged it; if the buffer fills up meanwhile, ``put`` moves the head (that batch too) to
the spool, and the writer then marks those lines as drained instead of removing them again.

Backpressure: above half of ``buffer_size`` the writer spools instead of waiting on Redis; at
``buffer_size`` (the writer is stuck on a slow Redis or disk) ``put`` spools the oldest jobs
itself. Jobs are dropped only when the spool's write fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import orjson
import redis.asyncio as aioredis
import structlog
from redis.exceptions import NoScriptError, ResponseError
from redis.typing import EncodableT

from router.ledger.epoch import LOST_REASON
from router.ledger.errors import REDIS_FAILURES, LedgerError
from router.ledger.records import chain_fields, with_chain
from router.ledger.schema import (
    advance_from,
    run_lineage_key,
    step_keys,
    stream_fields,
)
from router.ledger.scripts import Scripts
from router.ledger.spool import Job, Spool, job_from_line

BATCH = 256  # records per Redis pipeline and per spool write


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    lineage_maxlen: int = 1_000_000
    request_ttl_s: int = 7 * 24 * 3600
    buffer_size: int = 10_000
    spool_path: Path = Path("kvledger-spool.jsonl")
    spool_fsync_every: int = 64  # records, or
    spool_fsync_after_s: float = 0.05  # since the oldest unsynced one
    # How long a chain step remembers its answer, so that a retry (its reply was lost) neither
    # steps nor writes twice. One small key per request for this long. A step sent without an
    # answer and retried later than this (a proxy down for longer) cannot tell whether it ran:
    # it moves the chain to an unknown state and says so (``unordered``), see _run_steps.
    step_ttl_s: int = 3600
    redis_timeout_s: float = 0.5
    # WAIT 1 <ms> after an eval step (durable_wait_ms) or a production one (production_wait_ms)
    # when its master has a replica; 0: no WAIT (see ``core.Durability``).
    durable_wait_ms: int = 0
    production_wait_ms: int = 0
    retry_interval_s: float = 0.5
    close_timeout_s: float = 5.0


class Writer:
    def __init__(
        self,
        client: aioredis.Redis,
        scripts: Scripts,
        config: LedgerConfig,
        log: structlog.typing.FilteringBoundLogger,
        ensure_unknown: Callable[[str, str], Awaitable[int]],
        epoch: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        self._client, self._scripts, self._cfg, self._log = client, scripts, config, log
        self._ensure_unknown = ensure_unknown
        # Checks the ledger epoch (see ``epoch``) and answers the current one's id; called
        # when Redis is found back, before anything spooled is drained into it.
        self._epoch = epoch
        self._epoch_due = True
        self.epoch: str | None = None
        self.spool = Spool(config.spool_path, log)
        self.buffer: deque[Job] = deque()
        self.redis_up = True
        self.steps_in_buffer = 0
        self.spooled_total = self.written_total = self.dropped_total = 0
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()  # set after every cycle, for close()
        self._unsynced = 0
        self._sync_due = 0.0
        self._next_probe = 0.0
        self._task: asyncio.Task[None] | None = None

    def put(self, job: Job) -> None:
        self.buffer.append(job)
        self.steps_in_buffer += job.step is not None
        if len(self.buffer) >= self._cfg.buffer_size:
            self.spill(BATCH)
        self._wake.set()

    def index(self, request_id: str, run: object, data: bytes) -> None:
        """Queue an eval record's entry in its run's stream (``kvl:{run:ID}:lineage``)."""
        self.put(Job(request_id, None if run is None else str(run), data))

    def drop(self, request_id: str, reason: str) -> None:
        self.dropped_total += 1
        self._log.error("ledger_record_dropped", request_id=request_id, reason=reason)

    def went_down(self, exc: BaseException) -> None:
        if self.redis_up:
            self._log.warning("ledger_redis_down", error=f"{type(exc).__name__}: {exc}")
        self.redis_up = False
        self._epoch_due = True
        self._next_probe = time.monotonic() + self._cfg.retry_interval_s
        self._wake.set()
        self._progress.set()

    def spill(self, limit: int) -> None:
        """Move up to ``limit`` jobs from the head of the buffer to the end of the spool."""
        jobs = [self.buffer.popleft() for _ in range(min(limit, len(self.buffer)))]
        if not jobs:
            return
        self.steps_in_buffer -= sum(job.step is not None for job in jobs)
        if not self.spool.append(jobs):
            for job in jobs:
                self.drop(job.request_id, "spool write failed")
            return
        self.spooled_total += len(jobs)
        if self._unsynced == 0:
            self._sync_due = time.monotonic() + self._cfg.spool_fsync_after_s
        self._unsynced += len(jobs)

    async def run(self) -> None:
        """The writer task: never returns, never raises but for cancellation."""
        while True:
            try:
                await self._cycle()
                self._progress.set()
            except Exception:  # a bug must not stop the ledger: log it, back off, go on
                self._log.exception("ledger_writer_failed")
                await asyncio.sleep(self._cfg.retry_interval_s)

    async def _cycle(self) -> None:
        await self._sync_if_due()
        high_water = len(self.buffer) > self._cfg.buffer_size // 2
        if self.buffer and (not self.redis_up or high_water):
            self.spill(BATCH)
            await asyncio.sleep(0)  # one batch of disk writes at a time, then let others run
        elif not self.redis_up:
            if time.monotonic() < self._next_probe or not await self.probe():
                await self._idle()
        elif self.spool.pending:
            await self._drain_spool()
        elif self.buffer:
            await self._drain_buffer()
        else:
            await self._idle()

    async def probe(self) -> bool:
        try:
            async with asyncio.timeout(self._cfg.redis_timeout_s):
                await self._client.ping()
        except REDIS_FAILURES as exc:
            self.went_down(exc)
            return False
        if self._epoch_due and self._epoch is not None:
            try:
                self.epoch = await self._epoch()
            except REDIS_FAILURES as exc:
                self.went_down(exc)
                return False
            except LedgerError as exc:
                self.went_down(exc)
                return False
            self._epoch_due = False
        if not self.redis_up:
            self._log.info("ledger_redis_up", spooled=self.spool.count)
        self.redis_up = True
        return True

    async def start(self) -> None:
        """Open the spool (draining what a previous process left), then start the task."""
        await asyncio.to_thread(self.spool.open)
        if self.spool.count:
            path, count = str(self.spool.path), self.spool.count
            self._log.info("ledger_spool_found", path=path, spooled=count)
        await self.probe()
        self._task = asyncio.create_task(self.run(), name="kvl-ledger-writer")

    async def close(self) -> None:
        """Write what Redis takes within close_timeout_s; spool the rest; release the spool."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._cfg.close_timeout_s):
                while self._task and self.redis_up and (self.buffer or self.spool.pending):
                    self._progress.clear()
                    await self._progress.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self.buffer:  # blocking writes, but only once, at shutdown
            self.spill(BATCH)
        await self.sync()
        self.spool.close()
        self._log.info("ledger_closed", written_total=self.written_total, spooled=self.spool.count)

    async def _idle(self) -> None:
        """Sleep until a submit, the next fsync or the next probe, whichever comes first."""
        self._wake.clear()
        if self.buffer:  # a submit came while we were awaiting something else
            return
        now = time.monotonic()
        deadlines = [self._sync_due] if self._unsynced else []
        if not self.redis_up:
            deadlines.append(self._next_probe)
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        try:
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _sync_if_due(self) -> None:
        if not self._unsynced:
            return
        if self._unsynced < self._cfg.spool_fsync_every and time.monotonic() < self._sync_due:
            return
        self._unsynced = 0
        await self.sync()

    async def sync(self) -> None:
        try:
            await asyncio.to_thread(self.spool.fsync)
        except OSError as exc:
            self._log.error("ledger_spool_fsync_failed", path=str(self.spool.path), error=str(exc))

    async def _drain_spool(self) -> None:
        start, end = self.spool.done, self.spool.size
        lines = await asyncio.to_thread(self.spool.read, start, end, BATCH)
        if not lines:  # only a torn write's remains are left
            await self._mark_done(end, 0)
            return
        jobs: list[Job] = []
        bad: list[int] = []
        for end, line in lines:
            try:
                jobs.append(self.spool.with_tried(job_from_line(line)))
            except (ValueError, KeyError, TypeError, IndexError):
                if line.strip():
                    bad.append(end)
        if await self._send(jobs, from_buffer=False):
            for end in bad:
                self.drop("?", f"unreadable spool line ending at byte {end}")
            await self._mark_done(lines[-1][0], len(jobs) + len(bad))

    async def _drain_buffer(self) -> None:
        batch = [self.buffer[i] for i in range(min(BATCH, len(self.buffer)))]
        if not await self._send(batch, from_buffer=True):
            return  # still at the head of the buffer (or spilled in order): retried later
        spilled = [job for job in batch if job.spool_end is not None]
        for job in batch:
            if self.buffer and self.buffer[0] is job:
                self.buffer.popleft()
                self.steps_in_buffer -= job.step is not None
        if spilled:  # put() spooled them while they were in flight: they are the spool's head
            await self._mark_done(max(job.spool_end or 0 for job in spilled), len(spilled))

    async def _mark_done(self, offset: int, lines: int) -> None:
        """Record progress; once all of the spool is in Redis, empty it (see ledger_spool)."""
        self.spool.mark_done(offset, lines)
        if self.spool.pending:
            return
        end = self.spool.size
        await asyncio.to_thread(self.spool.save_marker, 0, True)
        if not self.spool.truncate(end):  # lines came in meanwhile: keep them, and the offset
            self.spool.save_marker(self.spool.done)

    async def _send(self, jobs: list[Job], *, from_buffer: bool) -> bool:
        """Run the jobs' due chain steps, then write their records; False if Redis failed."""
        try:
            await self._run_steps([job for job in jobs if job.step is not None], from_buffer)
            await self._write(jobs)
        except REDIS_FAILURES as exc:
            self.went_down(exc)
            return False
        self.written_total += len(jobs)
        return True

    async def _run_steps(self, jobs: list[Job], from_buffer: bool) -> None:
        """Run the jobs' steps in order. A step made in an epoch that is gone, or whose chain
        vanished (Redis lost its data), steps the replica's current chain instead, as an
        uncertain step (``unordered``, its state unknown), its record saying why."""
        if not jobs:
            return
        epoch = self.epoch
        chains: dict[str, int] = {}  # replica -> its current generation, asked once a batch
        for job in jobs:
            due = job.step
            assert due is not None
            if due.epoch is not None and epoch is not None and due.epoch != epoch:
                await self._into_new_chain(job, chains)
        replies = await self._pipeline_steps(jobs)
        lost = [
            job for job, reply in zip(jobs, replies, strict=True) if advance_from("", reply) is None
        ]
        chains.clear()
        for job in lost:  # Redis lost the chain meanwhile: an unknown one, then the step
            await self._into_new_chain(job, chains)
        if lost:
            replies = await self._pipeline_steps(jobs)
        for job, reply in zip(jobs, replies, strict=True):
            assert job.step is not None
            step = advance_from(job.step.replica, reply)
            if step is None:
                raise ConnectionError("the chain vanished twice in one batch")
            job.data = with_chain(job.data, chain_fields(step, job.step.exact))
            # Still in the buffer unless put() spooled it meanwhile (spill counted it then).
            self.steps_in_buffer -= from_buffer and job.spool_end is None
            job.step = None

    async def _into_new_chain(self, job: Job, chains: dict[str, int]) -> None:
        """``job``'s step, moved to the replica's chain as Redis holds it now (created unknown
        when absent): Redis lost the history it belonged to. Its record takes that generation
        and the warning ``Redis lost its data``; the step is uncertain (``tried_ms`` 0)."""
        step = job.step
        assert step is not None
        generation = chains.get(step.replica)
        if generation is None:
            generation = await self._ensure_unknown(step.replica, _engine(job.data))
            chains[step.replica] = generation
        job.step = replace(step, generation=generation, exact=False, tried_ms=0, epoch=self.epoch)
        record = orjson.loads(job.data)
        record["generation"] = generation
        earlier = str(record.get("warning") or "")
        if not earlier.startswith(LOST_REASON):
            record["warning"] = f"{LOST_REASON}; {earlier}" if earlier else LOST_REASON
        job.data = orjson.dumps(record)

    async def _pipeline_steps(self, jobs: list[Job]) -> list[object]:
        """Every job's step in one pipeline. A step that was sent before and may have run
        long ago (its step key may have expired) is run as *uncertain*: see ``scripts``.
        Every step is marked tried before it is sent (in memory and in the spool's tried
        list), so that a lost reply never makes its retry look like a first try."""
        fresh = [job for job in jobs if job.step is not None and job.step.tried_ms is None]
        if fresh:
            now_ms = int(time.time() * 1000)
            try:
                ids = [j.request_id for j in fresh]
                await asyncio.to_thread(self.spool.mark_tried, ids, now_ms)
            except OSError as exc:  # still marked in memory, for as long as this process lives
                self._log.error("ledger_tried_write_failed", error=str(exc))
            for job in fresh:
                step = job.step
                assert step is not None
                job.step = replace(step, tried_ms=now_ms)
        try:
            return await self._send_steps(jobs)
        except ResponseError as exc:
            if not isinstance(exc, NoScriptError) and not str(exc).startswith("NOSCRIPT"):
                raise
        # A cluster's pipeline sends EVALSHA as it is (redis-py's single-node pipeline loads
        # the scripts itself): a master promoted in a failover has none cached. Load them on
        # every master, then send the batch again (its steps are idempotent: their step keys).
        await self._scripts.load()
        return await self._send_steps(jobs)

    async def _send_steps(self, jobs: list[Job]) -> list[object]:
        pipe = self._client.pipeline(transaction=False)
        # Older than its step key's life (less a margin for clocks): the key may be gone.
        ttl = self._cfg.step_ttl_s
        horizon = time.time() * 1000 - (ttl - min(60, ttl / 2)) * 1000
        for job in jobs:
            step = job.step
            assert step is not None
            keys = step_keys(step.replica, job.request_id)
            args: list[EncodableT] = [
                step.generation,
                step.digest,
                job.data,
                self._cfg.step_ttl_s,
                self._cfg.lineage_maxlen,
                int(step.exact),
                job.request_id,
                self._cfg.request_ttl_s,
            ]
            uncertain = step.tried_ms is not None and step.tried_ms < horizon
            script = self._scripts.uncertain_step if uncertain else self._scripts.step
            await script(keys=keys, args=args, client=pipe)
        async with asyncio.timeout(self._cfg.redis_timeout_s):
            replies: list[object] = await pipe.execute()
        return replies

    async def _write(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        indexed = [job for job in jobs if job.run is not None]
        if not indexed:
            return
        pipe = self._client.pipeline(transaction=False)
        for job in indexed:
            pipe.xadd(run_lineage_key(str(job.run)), stream_fields(job.request_id, job.data))
        async with asyncio.timeout(self._cfg.redis_timeout_s):
            await pipe.execute()


def _engine(data: bytes) -> str:
    return str(orjson.loads(data).get("engine_digest", ""))
