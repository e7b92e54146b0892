"""Generation tracking: notice when a replica's cache was emptied behind the proxy's back.

Every few seconds each replica is asked for readiness, Triton's request counter for the model
and the engine's cache counters. A restart or a reload shows as counters that went backwards,
or as a model that was unavailable and came back; either way its KV cache started empty, so the
generation rises by one and ``kvl:generations`` says why. The new generation's state is
genesis only if the cache is still empty when the monitor looks (no request served since);
otherwise requests nobody recorded may have filled it, and the state is unknown.

Each tick also checks the ledger epoch (``router.ledger.epoch``, one GET): when Redis lost its
data, every replica starts a new generation whose state is unknown, with the reason ``Redis
lost its data`` (whichever found the loss first, this tick or the ledger's writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from backends.base import BackendError, ReplicaCounters
from router.fleet import Fleet, ReplicaState
from router.ledger import Ledger, LedgerError
from router.ledger.epoch import LOST_REASON

_log = structlog.get_logger("kvledger.monitor")


def generation_change(
    before: ReplicaCounters | None, now: ReplicaCounters, was_down: bool
) -> str | None:
    """Why the replica's cache must be considered new, or None (pure; tested on its own)."""
    if not now.ready:
        return None
    if was_down:
        return "model unavailable, then ready again"
    if before is None or not before.ready:
        return None
    for name, old, new in (
        ("request counter", before.request_count, now.request_count),
        ("iteration counter", before.iteration_counter, now.iteration_counter),
        ("reused-block counter", before.reused_blocks, now.reused_blocks),
    ):
        if new < old:
            return f"{name} went backwards ({old:g} -> {new:g}): restart or reload"
    return None


class Monitor:
    """One polling task for the whole fleet; owned by the app's cleanup context."""

    def __init__(
        self,
        fleet: Fleet,
        ledger: Ledger,
        interval_s: float,
        hook: Callable[[], Awaitable[None]] | None = None,
        check_timeout_s: float = 3.0,
    ) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.interval_s = interval_s
        # A replica that cannot answer its health check in this long (stopped, overloaded) is
        # unhealthy now, not after the backend's own timeouts: routing moves away within a tick.
        self.check_timeout_s = check_timeout_s
        self.hook = hook  # runs first each tick (leases and resets from Redis, idle runs)
        self._down: dict[str, bool] = {}
        self._pending: dict[str, str] = {}
        self._losses = 0  # epoch losses whose generations were started

    async def run(self) -> None:
        task = asyncio.current_task()
        while True:
            await self.tick()
            if task is not None and task.cancelling():
                # A cancellation that a library turned into a result or an error inside the
                # tick still ends the loop: shutdown must never wait on a monitor that goes on.
                raise asyncio.CancelledError
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        try:
            await self._check_epoch()
        except Exception as exc:  # noqa: BLE001 - health checks must go on whatever it raised
            _log.warning("monitor_epoch_check_failed", error=str(exc), kind=type(exc).__name__)
        if self.hook is not None:
            try:
                await self.hook()
            except Exception as exc:  # noqa: BLE001 - health checks must go on whatever it raised
                _log.warning("monitor_hook_failed", error=str(exc), kind=type(exc).__name__)
        await asyncio.gather(*(self.check(r) for r in self.fleet))
        self.fleet.monitor_ticks += 1

    async def _check_epoch(self) -> None:
        with contextlib.suppress(LedgerError):
            await self.ledger.check_epoch()
        losses = self.ledger.epoch.losses
        if losses > self._losses:
            with contextlib.suppress(LedgerError, BackendError):
                await self._history_lost()
                self._losses = losses

    async def _history_lost(self) -> None:
        """Redis lost its data: every replica seen so far starts an unknown generation."""
        for replica in self.fleet:
            if not replica.engine_digest:  # never synced: its first sync starts its chain
                continue
            count = replica.counters.request_count if replica.counters is not None else 0
            head = await self.ledger.new_generation(
                replica.id,
                replica.engine_digest,
                LOST_REASON,
                proven_empty=False,
                counter=int(count),
            )
            replica.generation = head.generation
            _log.warning(
                "generation_raised",
                replica=replica.id,
                generation=head.generation,
                reason=LOST_REASON,
            )

    async def check(self, replica: ReplicaState) -> None:
        if replica.paused:
            # A verified reset is under way; it raises the generation itself. The counters
            # going to zero must not read as a restart, so the baseline starts afresh.
            replica.counters = None
            self._down.pop(replica.id, None)
            return
        try:
            async with asyncio.timeout(self.check_timeout_s):
                now = await replica.backend.counters()
        except BackendError:
            now = ReplicaCounters(ready=False)
        except TimeoutError:
            # Unresponsive is not down: nothing says its cache was emptied, so the generation
            # stays; a restart behind it shows as counters that went backwards.
            if replica.healthy:
                _log.warning(
                    "replica_unresponsive", replica=replica.id, after_s=self.check_timeout_s
                )
            replica.healthy = False
            return
        if replica.paused:  # a reset began while the counters were being read
            return
        if not now.ready:
            if replica.healthy or replica.id not in self._down:
                _log.warning("replica_not_ready", replica=replica.id)
            replica.healthy = False
            # Only a replica that had been seen serving can "come back" with an empty cache.
            self._down[replica.id] = replica.counters is not None
            return
        reason = generation_change(replica.counters, now, self._down.get(replica.id, False))
        if reason is not None:
            self._pending[replica.id] = reason
        replica.answered(now, time.monotonic())
        replica.engine_seen(replica.counters, now, asyncio.get_running_loop().time())
        replica.counters = now
        self._down[replica.id] = False
        with contextlib.suppress(LedgerError, BackendError):
            await self._sync(replica, now)

    async def _sync(self, replica: ReplicaState, counters: ReplicaCounters) -> None:
        """Bring the ledger's generation up to date; retried next tick if Redis is away.

        A generation starts at genesis only when the cache is proven empty (the request counter
        and the engine's used-blocks gauge both read 0); otherwise its state is unknown.
        """
        digest = await replica.backend.engine_digest()
        facts = await replica.backend.engine_facts()
        replica.engine_max_input_len = facts.prompt_limit or 0
        replica.engine_max_seq_len = facts.max_seq_len or 0
        replica.tokens_per_block = facts.tokens_per_block or replica.settings.tokens_per_block
        replica.model_inputs = dict(facts.model_inputs)
        empty = counters.proven_empty
        count = counters.request_count
        head = await self.ledger.ensure_replica(
            replica.id, digest, proven_empty=empty, counter=count
        )
        reason = self._pending.pop(replica.id, None)
        if reason is not None and head.generation > replica.generation > 0:
            # Another proxy (or a verified reset) already raised it for this same event.
            _log.info("generation_adopted", replica=replica.id, generation=head.generation)
        elif reason is not None:
            head = await self.ledger.new_generation(
                replica.id, digest, reason, proven_empty=empty, counter=count
            )
            _log.info(
                "generation_raised", replica=replica.id, generation=head.generation, reason=reason
            )
        replica.generation = head.generation
        replica.engine_digest = digest
