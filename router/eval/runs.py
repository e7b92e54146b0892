"""Eval runs: begin (lease, reset or replay), end, fail, and end by idle timeout.

A run's replica is the first free one in the rendezvous order of the arm's name over the
replicas its cache mode allows (reuse on for ``reset``, ``replay:`` and ``shared``, off for
``off``), so reruns of an arm land on the same replica while it is healthy and free. The lease
is taken under a fleet-wide lock so that ``min_production_replicas`` always stay with
production. A failed run stays its arm's current run, answering 503 with the reason, until it
is ended or a new run is begun: nothing moves it silently to another replica.

Run status: ``beginning`` → ``live`` → ``ended`` (explicitly, superseded, or idle), or
``failed`` (the begin failed, or its replica failed mid-run).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass

import structlog

from backends.base import BackendError
from policies import rendezvous_order
from router.errors import Conflict, KvlError, NotFound, Unavailable
from router.eval.profiles import REPLAY, now_iso
from router.eval.replay import replay
from router.eval.reset import ResetFailed, verified_reset, wait_idle
from router.fleet import Fleet, ReplicaState
from router.ledger import Ledger, LedgerError
from router.ledger.keys import Profile
from router.ledger.runs import RunStore
from router.ledger.turns import Turns
from router.settings import EvalSettings

Meta = dict[str, str]
BEGIN_BUDGET_S = 600.0  # a begin (drain, reload, replay) longer than this is presumed dead
BEGIN_BUDGET_S_MS = int(BEGIN_BUDGET_S * 1000)
_log = structlog.get_logger("kvledger.runs")


@dataclass(frozen=True, slots=True)
class Lease:
    replica: ReplicaState
    reason: str


class Runs:
    """One per proxy instance; all shared state lives in Redis (``RunStore``, ``Turns``)."""

    def __init__(
        self,
        fleet: Fleet,
        ledger: Ledger,
        store: RunStore,
        turns: Turns,
        settings: EvalSettings,
        settle_s: float,
    ) -> None:
        self.fleet, self.ledger, self.store, self.turns = fleet, ledger, store, turns
        self.settings = settings
        self.settle_s = settle_s
        self._arm_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def for_request(self, profile: Profile, model: str) -> Meta:
        """The arm's current run, begun now if it has none; waits while another proxy begins."""
        meta = await self._current(profile.name)
        if meta is None:
            async with self._arm_locks[profile.name]:
                meta = await self._current(profile.name)
                if meta is None:
                    return await self._begin(profile, model, "first request")
        return await self._settled(meta)

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
            return await self._begin(profile, model, "begun explicitly")

    async def end(self, run: str, reason: str, status: str = "ended") -> Meta:
        meta = await self.store.get(run)
        if meta is None:
            raise NotFound(f"no run '{run}'")
        if meta.get("status") in ("ended", "failed") and status == "ended":
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

    async def fail(self, run: str, reason: str) -> None:
        """Mark the run failed and free its replica; its arm keeps pointing at it (503s)."""
        try:
            await self.end(run, reason, status="failed")
        except (LedgerError, KvlError) as exc:
            _log.error("run_fail_unrecorded", run=run, reason=reason, error=str(exc))

    async def tick(self) -> None:
        """The monitor's hook: learn leases and resets from Redis, end idle runs."""
        marks = await self.turns.marks(r.id for r in self.fleet)
        for replica in self.fleet:
            replica.leased_by, replica.resetting = marks[replica.id]
        for run in await self.store.live():
            meta = await self.store.get(run)
            if meta is None:  # deleted by hand: forget it
                await self.store.update(run, {}, ended=True)
            elif await self.store.current(meta["arm"]) != run:
                await self.end(run, "idle timeout")

    async def _current(self, arm: str) -> Meta | None:
        run = await self.store.current(arm)
        if run is None:
            return None
        # Claimed but not yet recorded: another proxy is leasing for it.
        return await self.store.get(run) or {"id": run, "arm": arm, "status": "beginning"}

    async def _settled(self, meta: Meta) -> Meta:
        """Wait out another proxy's begin; a failed run answers with its reason."""
        deadline = time.monotonic() + BEGIN_BUDGET_S
        while meta.get("status") == "beginning" and time.monotonic() < deadline:
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

    async def _begin(self, profile: Profile, model: str, trigger: str) -> Meta:
        arm = profile.name
        run = f"{arm}.{await self.store.number(arm)}"
        idle_ms = int(profile.idle_timeout_s * 1000)
        if not await self.store.claim(arm, run, idle_ms + int(BEGIN_BUDGET_S * 1000)):
            raise Conflict(f"arm '{arm}' is beginning another run; retry")
        meta: Meta = {
            "id": run,
            "arm": arm,
            "cache": profile.cache or "shared",
            "model": model,
            "status": "beginning",
            "began_at": now_iso(),
            "trigger": trigger,
            "idle_timeout_s": f"{profile.idle_timeout_s:g}",
        }
        try:
            lease = await self._lease(run, profile, model)
        except BaseException:
            # Nothing to record: the run never held a replica (the 503 says why).
            await asyncio.shield(self.store.release(arm, run))
            raise
        meta["replica"] = lease.replica.id
        await self.store.create(run, meta, int(time.time() * 1000))
        try:
            meta.update(await self._prepare(run, arm, meta["cache"], lease.replica))
            meta.update(choice=lease.reason, status="live")
            await self.store.update(run, meta)
            await self.store.touch(arm, run, idle_ms)
            await self.turns.renew_lease(lease.replica.id, run, idle_ms)
        except (ResetFailed, LedgerError, BackendError) as exc:
            reason = exc.message if isinstance(exc, ResetFailed) else str(exc)
            await self._abort(run, arm, lease, f"run begin failed: {reason}")
            raise Unavailable(
                f"run {run} of arm '{arm}' could not begin: {reason}",
                headers={"Retry-After": "5", "X-Kvl-Run": run},
            ) from exc
        except BaseException as exc:
            await asyncio.shield(self._abort(run, arm, lease, f"run begin failed: {exc!r}"))
            raise
        _log.info("run_live", run=run, replica=meta["replica"], cache=meta["cache"])
        return meta

    async def _abort(self, run: str, arm: str, lease: Lease, reason: str) -> None:
        meta = {"status": "failed", "ended_at": now_iso(), "end_reason": reason}
        try:
            lease.replica.leased_by = None
            await self.turns.free_lease(lease.replica.id, run)
            await self.store.update(run, meta, ended=True)
            await self.store.release(arm, run)
        except LedgerError as exc:
            _log.error("run_abort_unrecorded", run=run, error=str(exc))

    async def _prepare(self, run: str, arm: str, cache: str, replica: ReplicaState) -> Meta:
        """Bring the leased replica to the run's starting state; the run's fields that says so."""
        s = self.settings
        fields: Meta = {}
        if cache == "reset" or cache.startswith(REPLAY):
            report = await verified_reset(
                replica,
                self.ledger,
                self.turns,
                reason=f"verified reset: run {run} begins",
                settle_s=self.settle_s,
                drain_timeout_s=s.drain_timeout_s,
                run=run,
            )
            fields.update(report.as_fields())
        else:  # shared, off: no reset, but nothing else may run there from now on
            waited = await wait_idle(replica, self.settle_s, s.drain_timeout_s)
            fields["waited_ms"] = f"{waited * 1000:.0f}"
        if cache.startswith(REPLAY):
            name = cache[len(REPLAY) :]
            snapshot = await self.store.snapshot(name)
            if snapshot is None:
                raise ResetFailed(f"snapshot '{name}' does not exist")
            requests = snapshot["requests"]
            expected = str(snapshot["fingerprint"])
            label = f"snapshot '{name}'"
            await replay(self.ledger, replica, run, arm, requests, expected=expected, label=label)
            fields["replayed"] = str(len(requests))
        head = await self.ledger.head(replica.id)
        count = await replica.backend.request_count()
        await self.turns.set_run_counter(replica.id, run, count)
        fields.update(
            generation=str(head.generation),
            seq=str(head.seq),
            state=head.state,
            engine_digest=head.engine_digest,
        )
        return fields

    async def _lease(self, run: str, profile: Profile, model: str) -> Lease:
        """The first free replica in the arm's rendezvous order (see the module docstring)."""
        reuse = profile.cache != "off"
        serving = self.fleet.serving(model)
        allowed = [r.id for r in serving if r.settings.reuse == reuse]
        if profile.replica is not None:
            allowed = [r for r in allowed if r == profile.replica]
        order = rendezvous_order(profile.name, allowed)
        skipped: list[str] = []
        async with self.turns.lease_lock():
            marks = await self.turns.marks(r.id for r in serving)
            for replica in serving:
                replica.leased_by = marks[replica.id][0]
            for rank, replica_id in enumerate(order, 1):
                replica = self.fleet[replica_id]
                why = self._unleasable(replica, serving)
                if why is None:
                    holder = await self.turns.take_lease(replica_id, run, BEGIN_BUDGET_S_MS)
                    if holder is None:
                        replica.leased_by = run
                        reason = f"rendezvous rank {rank} of {len(order)} for arm '{profile.name}'"
                        return Lease(replica, reason + "".join(f"; {s}" for s in skipped))
                    why = f"leased by run {holder}"
                skipped.append(f"{replica_id} skipped: {why}")
        kind = "reuse on" if reuse else "reuse off"
        raise Unavailable(
            f"no replica can be leased for arm '{profile.name}' (model {model}, {kind}"
            + (f", pinned to {profile.replica}" if profile.replica else "")
            + "): "
            + ("; ".join(skipped) or "none configured"),
            headers={"Retry-After": "5"},
        )

    def _unleasable(self, replica: ReplicaState, serving: list[ReplicaState]) -> str | None:
        if not replica.healthy:
            return "not healthy"
        if replica.draining:
            return "draining"
        if replica.leased_by is not None:
            return f"leased by run {replica.leased_by}"
        # Only the production pool counts: an eval-only replica left free serves no production.
        left = sum(
            1
            for r in serving
            if r is not replica
            and r.production
            and r.healthy
            and not r.draining
            and r.leased_by is None
        )
        minimum = self.settings.min_production_replicas
        if left < minimum:
            return f"leasing it would leave {left} replica(s) to production (minimum {minimum})"
        return None
