"""Eval runs: begin (``begin``), end, fail, break, and end by idle timeout.

A failed or broken run stays its arm's current run, answering 503 with the reason, until it is
ended or a new run is begun: a run moves to another replica only by a verified failover,
recorded in the run (``router.eval.failover``), never silently.

Run status: ``beginning`` → ``live`` → ``ended`` (explicitly, superseded, or idle), or
``failed`` (the begin failed, its proxy died while beginning, or a reset for it was
interrupted), or ``broken`` (its chain order is no longer the cache's order: its lease or its
turn was lost, or a chain step had to wait for Redis; or its replica failed and it could not
move: ``router.eval.failover``).

Each monitor tick (``tick``) learns leases and reset marks, finishes resets whose proxy died
(``reset.Resetter.recover``), fails beginning runs whose proxy died, and ends idle runs.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import structlog

from router.errors import KvlError, NotFound, Unavailable
from router.eval import begin as beginning
from router.eval.profiles import now_iso
from router.eval.reset import Resetter
from router.fleet import Fleet
from router.ledger import Ledger, LedgerError
from router.ledger.keys import Profile
from router.ledger.notices import Notices
from router.ledger.runs import RunStore
from router.ledger.turns import Turns
from router.settings import EvalSettings

Meta = dict[str, str]
_log = structlog.get_logger("kvledger.runs")


class Runs:
    """One per proxy instance; all shared state lives in Redis (``RunStore``, ``Turns``)."""

    def __init__(
        self,
        fleet: Fleet,
        ledger: Ledger,
        store: RunStore,
        turns: Turns,
        settings: EvalSettings,
        *,
        notices: Notices,
        settle_s: float,
        owner: str,
        heartbeat_s: float,
    ) -> None:
        self.fleet, self.ledger, self.store, self.turns = fleet, ledger, store, turns
        self.settings = settings
        self.settle_s = settle_s  # other proxies learn a lease within this: resets wait as long
        self.owner = owner  # this proxy instance, for the claims it holds
        self.heartbeat_s = heartbeat_s
        self.owner_ttl_ms = int(heartbeat_s * 3000)
        self.notices = notices
        self.resets = Resetter(
            ledger,
            turns,
            notices,
            owner,
            settle_s=settle_s,
            drain_timeout_s=settings.drain_timeout_s,
            reload_timeout_s=settings.reload_timeout_s,
            heartbeat_s=heartbeat_s,
        )
        self._arm_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._unrecorded: dict[str, tuple[str, str]] = {}  # run -> (status, reason), for Redis

    async def for_request(self, profile: Profile, model: str) -> Meta:
        """The arm's current run, begun now if it has none; waits while another proxy begins."""
        meta = await self._current(profile.name)
        if meta is None or self._may_begin_again(meta, profile, model):
            async with self._arm_locks[profile.name]:
                meta = await self._current(profile.name)
                if meta is not None and self._may_begin_again(meta, profile, model):
                    await self.store.release(profile.name, meta["id"])
                    meta = None
                if meta is None:
                    return await beginning.begin(self, profile, model, "first request")
        return await self._settled(meta)

    def _may_begin_again(self, meta: Meta, profile: Profile, model: str) -> bool:
        """A run that failed to begin stays the arm's run (its requests answer 503 with the
        reason) until a replica can be leased again, as this proxy sees the fleet."""
        return meta.get("begin_failed") == "true" and beginning.can_begin(self, profile, model)

    async def still_live(self, run: str, arm: str) -> Meta:
        """The run as Redis holds it now; 503 with the reason if it ended or failed meanwhile."""
        meta = await self.store.get(run) or {"id": run, "arm": arm, "status": "ended"}
        return await self._settled(meta)

    async def begin(self, profile: Profile, model: str) -> Meta:
        """A new run of the arm; its current run, if any, ends (superseded)."""
        async with self._arm_locks[profile.name]:
            current = await self.store.current(profile.name)
            if current is not None:
                await self.end(current, "superseded by a new run of the arm")
            return await beginning.begin(self, profile, model, "begun explicitly")

    async def end(self, run: str, reason: str, status: str = "ended") -> Meta:
        meta = await self.store.get(run)
        if meta is None:
            raise NotFound(f"no run '{run}'")
        if meta.get("status") in ("ended", "failed", "broken") and status == "ended":
            await self.store.release(meta["arm"], run)
            return meta
        fields = {"status": status, "ended_at": now_iso(), "end_reason": reason}
        await self.store.update(run, fields, ended=True)
        replica = meta.get("replica")
        if replica:
            await self.turns.free_lease(replica, run)
            if replica in self.fleet and self.fleet[replica].leased_by == run:
                self.fleet[replica].leased_by = None
        if status == "ended":
            await self.store.release(meta["arm"], run)
        _log.info("run_" + status, run=run, replica=replica, reason=reason)
        return {**meta, **fields}

    async def fail(self, run: str, reason: str, status: str = "failed") -> None:
        """Mark the run failed (or broken) and free its replica; its arm keeps pointing at it,
        so its requests answer 503 with the reason. Without Redis, retried each tick."""
        try:
            await self.end(run, reason, status=status)
        except (LedgerError, KvlError) as exc:
            self._unrecorded[run] = (status, reason)
            _log.error("run_fail_unrecorded", run=run, reason=reason, error=str(exc))
        else:
            self._unrecorded.pop(run, None)

    async def tick(self) -> None:
        """The monitor's hook: learn leases and resets, recover what dead proxies left behind,
        end idle runs (see the module docstring)."""
        await self.notices.alive(self.owner, expire_s=3 * self.settle_s)
        if await self.store.missing([r.id for r in self.fleet]):
            await self.register()
        marks = await self.turns.marks(r.id for r in self.fleet)
        for replica in self.fleet:
            replica.leased_by, replica.resetting = marks[replica.id]
        for replica_id in await self.turns.orphaned_resets(r.id for r in self.fleet):
            run = await self.resets.recover(self.fleet[replica_id])
            if run:
                reason = "its verified reset was interrupted: the proxy running it died"
                await self.fail(run, reason)
        for run, (status, reason) in list(self._unrecorded.items()):
            await self.fail(run, reason, status)
        for run in await self.store.live():
            await self._check(run)

    async def register(self) -> None:
        """Tell Redis which replicas exist (keys are checked against them without a proxy,
        and readers find the replicas' lineage streams through them)."""
        await self.store.register(
            {r.id: {"model": r.settings.model, "reuse": r.settings.reuse} for r in self.fleet}
        )

    async def on_notice(self, replica: str, mark: str) -> None:
        """A reset of ``replica`` was announced: stop admitting to it now, and say so."""
        if replica not in self.fleet or mark.startswith(self.owner + "@"):
            return
        self.fleet[replica].resetting = True
        try:
            await self.notices.ack(replica, self.owner, mark)
        except LedgerError as exc:  # the resetter then waits out one monitor interval
            _log.warning("reset_ack_failed", replica=replica, error=str(exc))

    async def _check(self, run: str) -> None:
        meta = await self.store.get(run)
        if meta is None:  # deleted by hand: forget it
            await self.store.update(run, {}, ended=True)
        elif meta.get("status") == "beginning":
            if not await self.store.owner_alive(run):
                await self.fail(run, "its begin was interrupted: the proxy beginning it died")
        elif await self.store.current(meta["arm"]) != run:
            await self.end(run, "idle timeout")

    async def _current(self, arm: str) -> Meta | None:
        run = await self.store.current(arm)
        if run is None:
            return None
        # Claimed but not yet recorded: another proxy is leasing for it.
        return await self.store.get(run) or {"id": run, "arm": arm, "status": "beginning"}

    async def _settled(self, meta: Meta) -> Meta:
        """Wait out another proxy's begin while that proxy lives; a failed, broken or ended run
        (or a begin whose proxy died) answers 503 with its reason at once."""
        while meta.get("status") == "beginning":
            if not await self.store.owner_alive(meta["id"]):
                meta = await self._orphaned(meta)
                break
            await asyncio.sleep(0.1)
            fresh = await self.store.get(meta["id"])
            if fresh is None and await self.store.current(meta["arm"]) != meta["id"]:
                raise Unavailable(
                    f"run {meta['id']} could not begin: no replica could be leased; retry",
                    headers={"Retry-After": "5"},
                )
            meta = fresh or meta
        if meta.get("status") == "live":
            return meta
        raise Unavailable(
            f"run {meta['id']} {meta.get('status')} (arm '{meta['arm']}'):"
            f" {meta.get('end_reason') or 'still beginning'}; begin a new run"
            f" (kvledger runs begin {meta['arm']}) or end it (kvledger runs end {meta['id']})",
            headers={"Retry-After": "5", "X-Kvl-Run": meta["id"]},
        )

    async def _orphaned(self, meta: Meta) -> Meta:
        """A beginning run whose proxy died: failed (recorded) or, if never recorded, gone."""
        reason = "its begin was interrupted: the proxy beginning it died"
        if await self.store.get(meta["id"]) is None:
            await self.store.release(meta["arm"], meta["id"])
            raise Unavailable(
                f"run {meta['id']} could not begin: {reason}; retry", headers={"Retry-After": "5"}
            )
        await self.fail(meta["id"], reason)
        return await self.store.get(meta["id"]) or {**meta, "status": "failed"}
