"""The verified reset (DESIGN.md §5): the only way to empty a TensorRT-LLM replica's KV cache.

Steps: mark the reset in Redis (its owner, with a heartbeat) and announce it: every proxy stops
admitting to the replica at once and acknowledges (``router.ledger.notices``); the reset waits
for the acknowledgements of the proxies alive lately, or ``settle_s`` (one monitor interval,
after which every proxy has seen the mark anyway), whichever comes first; wait until the replica
holds no request from anyone (the engine's active-request gauge, so other proxies' and direct
clients' requests count too), unload with dependents and load through the repository API, wait
until ready, confirm that the engine model's request counter restarted at zero and the
engine holds no block, then raise the generation: seq 0, state genesis, and a
``kvl:generations`` entry with the reason and the durations. A model that is not loaded at
all (a reset interrupted earlier) is simply loaded.

The unload and load take at most ``reload_timeout_s``; a reset that fails there (or is
interrupted) answers at once with the step that failed and leaves its intent behind.

Crash safety: the mark expires within seconds of its owner's death (no heartbeat), while the
reset's intent stays; any proxy's monitor then takes the reset over (:meth:`Resetter.recover`),
as it does a failed reset's: it loads the model once it is neither unloading nor loading, starts
a new generation (genesis only if the cache is proven empty) and fails the run the reset was
for, with the reason; until then, new resets of the replica are refused with that reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog

from backends.base import BackendError, ReplicaCounters
from router.eval.heartbeat import heartbeat
from router.fleet import ReplicaState
from router.ledger import ChainHead, Ledger, LedgerError
from router.ledger.notices import Notices
from router.ledger.turns import Turns

_log = structlog.get_logger("kvledger.reset")


class ResetFailed(Exception):
    """The replica could not be reset and verified; the message says which step failed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class ResetReport:
    replica: str
    generation: int
    state: str
    waited_s: float  # stopping admission until the replica was idle
    reload_s: float  # unload, load, ready, counters confirmed
    total_s: float

    def as_fields(self) -> dict[str, str]:
        return {
            "reset_generation": str(self.generation),
            "reset_waited_ms": f"{self.waited_s * 1000:.0f}",
            "reset_reload_ms": f"{self.reload_s * 1000:.0f}",
            "reset_ms": f"{self.total_s * 1000:.0f}",
        }


def _not_empty(counters: ReplicaCounters) -> str:
    if counters.used_blocks is None:
        return (
            f"after the reload the request counter reads {counters.request_count}, and the"
            " metrics page has no used-blocks gauge (nv_trt_llm_kv_cache_block_metrics):"
            " nothing proves its cache empty"
        )
    return (
        f"after the reload the request counter reads {counters.request_count} and"
        f" {counters.used_blocks:g} block(s) are in use, not 0 and 0: the model was not"
        " reloaded, so its cache may not be empty"
    )


async def wait_idle(replica: ReplicaState, settle_s: float, timeout_s: float) -> float:
    """Seconds until nothing runs on the replica (and at least ``settle_s``), or ResetFailed.
    A server whose model is not loaded runs nothing: it is idle at once."""
    began = time.monotonic()
    while True:
        try:
            counters = await replica.backend.counters()
            if not counters.ready and await replica.backend.model_state() != "READY":
                return time.monotonic() - began
        except BackendError as exc:
            raise ResetFailed(f"replica {replica.id} did not answer: {exc.detail}") from exc
        busy = replica.in_flight + int(counters.active)
        waited = time.monotonic() - began
        if busy == 0 and waited >= settle_s:
            return waited
        if waited > timeout_s:
            raise ResetFailed(
                f"replica {replica.id} still has {busy} request(s) in flight after {timeout_s:g} s"
            )
        await asyncio.sleep(0.05)


class Resetter:
    """Verified resets and their recovery, for one proxy instance (``owner``)."""

    def __init__(
        self,
        ledger: Ledger,
        turns: Turns,
        notices: Notices,
        owner: str,
        *,
        settle_s: float,
        drain_timeout_s: float,
        reload_timeout_s: float,
        heartbeat_s: float,
    ) -> None:
        self.ledger, self.turns, self.notices, self.owner = ledger, turns, notices, owner
        self.settle_s = settle_s
        self.drain_timeout_s = drain_timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.heartbeat_s = heartbeat_s

    @property
    def _ttl_ms(self) -> int:
        return int(self.heartbeat_s * 3000)

    async def reset(self, replica: ReplicaState, *, reason: str, run: str = "") -> ResetReport:
        """Reset ``replica`` and prove it (see the module docstring); ResetFailed says why not."""
        started = time.perf_counter()
        replica.reset_here = True
        try:
            mark = await self._mark(replica.id, reason, run)
            unfinished: str | None = None  # why the model may be left unloaded
            try:
                async with heartbeat(lambda: self._beat(replica.id), self.heartbeat_s) as beat:
                    acked = await self._acknowledged(replica.id, mark)
                    waited = acked + await wait_idle(replica, 0.0, self.drain_timeout_s)
                    reloaded = time.perf_counter()
                    try:
                        digest = await self._reload(replica)
                    except BaseException as exc:
                        unfinished = (
                            exc.message
                            if isinstance(exc, ResetFailed)
                            else "the reset was interrupted while reloading the model"
                        )
                        raise
                    reload_s = time.perf_counter() - reloaded
                if beat.lost is not None:
                    raise ResetFailed(f"replica {replica.id}: the reset lost its mark: {beat.lost}")
                details = _details(started, reload_s, waited, run)
                head = await self._generation(
                    replica.id, digest, reason, details, proven_empty=True
                )
            finally:
                await asyncio.shield(self._unmark(replica.id, unfinished))
        finally:
            replica.reset_here = False
            replica.resetting = False  # our own mark, just removed: no need to wait for a tick
        replica.generation, replica.engine_digest = head.generation, digest
        replica.healthy = True  # just confirmed ready: no need to wait for a monitor tick
        replica.counters = None  # the next monitor tick starts a new baseline
        _log.info("replica_reset", replica=replica.id, generation=head.generation, **details)
        total = time.perf_counter() - started
        return ResetReport(replica.id, head.generation, head.state, waited, reload_s, total)

    async def recover(self, replica: ReplicaState) -> str | None:
        """Finish a reset whose owner died or failed with the model touched: None when there
        was none to take over; else the run it was for ('' for none), which the caller fails.
        A model still unloading or loading, or one that does not load, is tried again at the
        next tick."""
        intent = await self.turns.take_over_reset(replica.id, self.owner, self._ttl_ms)
        if not intent:
            return None
        why = intent.get("failed") or f"its proxy {intent.get('dead_owner', '?')} died"
        _log.warning("reset_recovering", replica=replica.id, why=why)
        reason = f"verified reset unfinished ({why}); model loaded again"
        left: str | None = None
        try:
            counters = await self._ready(replica, waiting_ok=True)
            digest = await replica.backend.engine_digest()
            head = await self._generation(
                replica.id,
                digest,
                reason,
                {},
                proven_empty=counters.proven_empty,
                counter=counters.request_count,
            )
            replica.generation, replica.engine_digest = head.generation, digest
        except (BackendError, ResetFailed) as exc:
            left = why
            _log.warning("reset_recovery_retried", replica=replica.id, why=why, error=str(exc))
        finally:
            await asyncio.shield(self._unmark(replica.id, left))
        replica.counters = None
        return intent.get("run", "")

    async def _mark(self, replica: str, reason: str, run: str) -> str:
        """Mark and announce the reset; its mark id, which the proxies acknowledge."""
        started = datetime.now(UTC).isoformat(timespec="milliseconds")
        mark = f"{self.owner}@{started}"
        try:
            owner = await self.turns.begin_reset(
                replica, self.owner, self._ttl_ms, run=run, reason=reason, started=started
            )
            if not owner:
                await self.notices.announce(replica, mark)
        except LedgerError as exc:
            raise ResetFailed(f"cannot mark the reset in Redis: {exc}") from exc
        if owner.startswith("!"):
            raise ResetFailed(
                f"replica {replica}: an earlier reset did not finish ({owner[1:]}); the monitor"
                " is bringing the model back: retry in a few seconds"
            )
        if owner:
            raise ResetFailed(f"replica {replica} is being reset by another proxy ({owner})")
        return mark

    async def _acknowledged(self, replica: str, mark: str) -> float:
        """Seconds until every proxy alive lately has set the replica aside, at most
        ``settle_s`` (by then each has seen the mark at its monitor's tick anyway)."""
        began = time.monotonic()
        try:
            others = await self.notices.live_proxies(3 * self.settle_s) - {self.owner}
            while others and time.monotonic() - began < self.settle_s:
                if others <= await self.notices.acked(replica, mark):
                    break
                await asyncio.sleep(0.005)
        except LedgerError as exc:
            raise ResetFailed(f"cannot read the proxies' acknowledgements: {exc}") from exc
        return time.monotonic() - began

    async def _beat(self, replica: str) -> str | None:
        if await self.turns.reset_heartbeat(replica, self.owner, self._ttl_ms):
            return None
        return "another proxy took the reset over"

    async def _unmark(self, replica: str, unfinished: str | None = None) -> None:
        """End the reset; ``unfinished`` (why) leaves its intent for a monitor's recovery."""
        try:
            if unfinished is None:
                await self.turns.end_reset(replica, self.owner)
            else:
                await self.turns.leave_reset(replica, self.owner, unfinished)
        except LedgerError as exc:  # the mark expires by itself; the intent waits for recovery
            _log.warning("reset_unmark_failed", replica=replica, error=str(exc))

    async def _generation(
        self,
        replica: str,
        digest: str,
        reason: str,
        details: dict[str, str],
        *,
        proven_empty: bool,
        counter: int = 0,
    ) -> ChainHead:
        try:
            return await self.ledger.new_generation(
                replica, digest, reason, details, proven_empty=proven_empty, counter=counter
            )
        except LedgerError as exc:
            raise ResetFailed(f"reset done, but Redis did not take the generation: {exc}") from exc

    async def _ready(self, replica: ReplicaState, *, waiting_ok: bool = False) -> ReplicaCounters:
        """Load the model if it is not ready; its counters once it is. With ``waiting_ok``, a
        model still unloading or loading is left to finish (ResetFailed: try again later)."""
        backend = replica.backend
        try:
            if not await backend.ready():
                state = await backend.model_state()
                if waiting_ok and state in ("UNLOADING", "LOADING"):
                    raise ResetFailed(f"replica {replica.id}: the model is still {state}")
                await backend.load(self.reload_timeout_s)
            counters = await backend.counters()
        except BackendError as exc:
            raise ResetFailed(f"replica {replica.id}: {exc.detail}") from exc
        if not counters.ready:
            raise ResetFailed(f"replica {replica.id}: the model did not come back ready")
        return counters

    async def _reload(self, replica: ReplicaState) -> str:
        """Unload and load; the model must then be ready with no request and no block."""
        try:
            await replica.backend.reset(self.reload_timeout_s)
        except BackendError as exc:
            raise ResetFailed(f"replica {replica.id}: {exc.detail}") from exc
        counters = await self._ready(replica)
        if not counters.proven_empty:
            raise ResetFailed(f"replica {replica.id}: {_not_empty(counters)}")
        try:
            return await replica.backend.engine_digest()
        except BackendError as exc:
            raise ResetFailed(f"replica {replica.id}: {exc.detail}") from exc


def _details(started: float, reload_s: float, waited: float, run: str) -> dict[str, str]:
    details = {
        "duration_ms": f"{(time.perf_counter() - started) * 1000:.0f}",
        "reload_ms": f"{reload_s * 1000:.0f}",
        "waited_ms": f"{waited * 1000:.0f}",
    }
    if run:
        details["run"] = run
    return details
