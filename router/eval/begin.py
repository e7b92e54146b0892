"""Beginning a run: claim the arm, lease a replica, bring it to the run's starting state.

The proxy that begins a run owns it until it is live: ``kvl:{run:ID}:owner`` with a heartbeat.
If that proxy dies, the owner key expires within seconds; requests waiting on the run and every
proxy's monitor then see a beginning run without an owner, and fail it (``Runs``) instead of
waiting for a begin that will never finish.

Starting states: ``reset`` and ``replay:`` begin with a verified reset (``reset``), then
``replay:`` serves the snapshot's requests and checks the fingerprint; ``shared`` and ``off``
wait until the replica is idle (nothing else may run there from now on).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import structlog

from backends.base import BackendError
from router.errors import Conflict, Unavailable
from router.eval import continuity
from router.eval.heartbeat import heartbeat
from router.eval.leasing import Lease, lease, unleasable
from router.eval.profiles import REPLAY, now_iso
from router.eval.replay import replay
from router.eval.reset import ResetFailed, Resetter, wait_idle
from router.fleet import Fleet, ReplicaState
from router.ledger import Ledger, LedgerError
from router.ledger.keys import Profile
from router.ledger.runs import RunStore
from router.ledger.turns import Turns
from router.settings import EvalSettings

Meta = dict[str, str]
BEGIN_BUDGET_S = 600.0  # the arm's claim outlives a begin by this much at most
_log = structlog.get_logger("kvledger.runs")


class Runs(Protocol):
    """What beginning a run needs of the proxy's runs (``router.eval.runs.Runs``), declared here
    so that this module does not import the one that calls it."""

    fleet: Fleet
    ledger: Ledger
    store: RunStore
    turns: Turns
    settings: EvalSettings
    resets: Resetter
    settle_s: float
    owner: str
    owner_ttl_ms: int
    heartbeat_s: float


async def begin(runs: Runs, profile: Profile, model: str, trigger: str) -> Meta:
    """A new run of the arm, live on its leased replica; 503 (with the reason) if it cannot."""
    arm = profile.name
    run = f"{arm}.{await runs.store.number(arm)}"
    idle_ms = int(profile.idle_timeout_s * 1000)
    await runs.store.own(run, runs.owner, runs.owner_ttl_ms)  # before anyone can see the claim
    if not await runs.store.claim(arm, run, idle_ms + int(BEGIN_BUDGET_S * 1000)):
        await runs.store.disown(run)
        raise Conflict(f"arm '{arm}' is beginning another run; retry")
    meta: Meta = {
        "id": run,
        "arm": arm,
        "cache": profile.cache or "shared",
        "model": model,
        "status": "beginning",
        "began_at": now_iso(),
        "trigger": trigger,
        "owner": runs.owner,
        "idle_timeout_s": f"{profile.idle_timeout_s:g}",
        "pinned": profile.replica or "",  # a move (``failover``) leases as the key would
    }
    async with heartbeat(lambda: _own(runs, run), runs.heartbeat_s) as beat:
        try:
            held = await lease(
                runs.fleet,
                runs.turns,
                run,
                profile,
                model,
                ttl_ms=int(BEGIN_BUDGET_S * 1000),
                minimum=runs.settings.min_production_replicas,
            )
        except Unavailable as exc:
            # Recorded failed and kept as the arm's run: the arm's requests answer 503 with the
            # reason until a replica can be leased (``Runs.for_request``), not a run each.
            await _failed_to_begin(runs, meta, idle_ms, f"run begin failed: {exc.message}")
            raise
        except BaseException:
            await asyncio.shield(_release(runs, arm, run))
            raise
        meta["replica"] = held.replica.id
        await runs.store.create(run, meta, int(time.time() * 1000))
        await _prepare_or_abort(runs, meta, held)
        if beat.lost is not None:
            await _abort(runs, run, arm, held, f"run begin lost its owner: {beat.lost}")
            raise _unavailable(run, arm, f"the begin lost its claim ({beat.lost})")
    await _go_live(runs, meta, held, idle_ms)
    return meta


def can_begin(runs: Runs, profile: Profile, model: str) -> bool:
    """Whether, as this proxy sees the fleet, some replica could be leased for the arm now."""
    reuse = profile.cache != "off"
    serving = runs.fleet.serving(model)
    return any(
        r.settings.reuse == reuse
        and profile.replica in (None, r.id)
        and unleasable(r, serving, runs.settings.min_production_replicas) is None
        for r in serving
    )


async def _failed_to_begin(runs: Runs, meta: Meta, idle_ms: int, reason: str) -> None:
    fields = {"status": "failed", "ended_at": now_iso(), "end_reason": reason}
    try:
        await runs.store.create(meta["id"], {**meta, **fields, "begin_failed": "true"}, _now_ms())
        await runs.store.update(meta["id"], {}, ended=True)
        await runs.store.touch(meta["arm"], meta["id"], idle_ms)
        await runs.store.disown(meta["id"])
    except LedgerError as exc:
        _log.error("run_abort_unrecorded", run=meta["id"], error=str(exc))


async def _prepare_or_abort(runs: Runs, meta: Meta, held: Lease) -> None:
    run, arm = meta["id"], meta["arm"]
    try:
        meta.update(await _prepare(runs, run, arm, meta["cache"], held.replica))
    except (ResetFailed, LedgerError, BackendError) as exc:
        reason = exc.message if isinstance(exc, ResetFailed) else str(exc)
        await _abort(runs, run, arm, held, f"run begin failed: {reason}", keep=True)
        raise _unavailable(run, arm, reason) from exc
    except BaseException as exc:
        await asyncio.shield(_abort(runs, run, arm, held, f"run begin failed: {exc!r}"))
        raise


async def _go_live(runs: Runs, meta: Meta, held: Lease, idle_ms: int) -> None:
    run, arm = meta["id"], meta["arm"]
    # Another proxy may have failed the run meanwhile (it thought this one dead): respect that.
    current = await runs.store.get(run) or {}
    if current.get("status") != "beginning":
        reason = current.get("end_reason") or "it was ended while beginning"
        raise _unavailable(run, arm, reason)
    meta.update(choice=held.reason, status="live")
    await runs.store.update(run, meta)
    await runs.store.touch(arm, run, idle_ms)
    await runs.turns.renew_lease(held.replica.id, run, idle_ms)
    await runs.store.disown(run)
    _log.info("run_live", run=run, replica=meta["replica"], cache=meta["cache"])


async def _own(runs: Runs, run: str) -> str | None:
    await runs.store.own(run, runs.owner, runs.owner_ttl_ms)
    return None


async def _release(runs: Runs, arm: str, run: str) -> None:
    await runs.store.release(arm, run)
    await runs.store.disown(run)


def _unavailable(run: str, arm: str, reason: str) -> Unavailable:
    return Unavailable(
        f"run {run} of arm '{arm}' could not begin: {reason}",
        headers={"Retry-After": "5", "X-Kvl-Run": run},
    )


async def _abort(
    runs: Runs, run: str, arm: str, held: Lease, reason: str, *, keep: bool = False
) -> None:
    """Fail the beginning run; ``keep``: it stays the arm's run (see ``can_begin``)."""
    meta = {"status": "failed", "ended_at": now_iso(), "end_reason": reason}
    if keep:
        meta["begin_failed"] = "true"
    try:
        held.replica.leased_by = None
        await runs.turns.free_lease(held.replica.id, run)
        await runs.store.update(run, meta, ended=True)
        if keep:
            await runs.store.disown(run)
        else:
            await _release(runs, arm, run)
    except LedgerError as exc:
        _log.error("run_abort_unrecorded", run=run, error=str(exc))


async def _prepare(runs: Runs, run: str, arm: str, cache: str, replica: ReplicaState) -> Meta:
    """Bring the leased replica to the run's starting state; the run's fields that say so."""
    fields: Meta = {}
    if cache == "reset" or cache.startswith(REPLAY):
        report = await runs.resets.reset(
            replica, reason=f"verified reset: run {run} begins", run=run
        )
        fields.update(report.as_fields())
    else:  # shared, off: no reset, but nothing else may run there from now on
        waited = await wait_idle(replica, runs.settle_s, runs.settings.drain_timeout_s)
        fields["waited_ms"] = f"{waited * 1000:.0f}"
    if cache.startswith(REPLAY):
        name = cache[len(REPLAY) :]
        snapshot = await runs.store.snapshot(name)
        if snapshot is None:
            raise ResetFailed(f"snapshot '{name}' does not exist")
        requests = snapshot["requests"]
        expected = str(snapshot["fingerprint"])
        label = f"snapshot '{name}'"
        await replay(runs.ledger, replica, run, arm, requests, expected=expected, label=label)
        fields["replayed"] = str(len(requests))
    head = await runs.ledger.head(replica.id)
    count = await continuity.settled(replica)
    await runs.turns.set_run_counter(replica.id, run, count)
    fields.update(
        generation=str(head.generation),
        seq=str(head.seq),
        state=head.state,
        state_known=str(head.known).lower(),
        engine_digest=head.engine_digest,
    )
    return fields


def _now_ms() -> int:
    return int(time.time() * 1000)
