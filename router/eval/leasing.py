"""Choosing and leasing a run's replica, reproducibly.

A run's replica is the first free one in the rendezvous order of the arm's name over the
replicas its cache mode allows (reuse on for ``reset``, ``replay:`` and ``shared``, off for
``off``; or the key's pinned replica), so reruns of an arm land on the same replica while it is
healthy and free. The lease is taken under a fleet-wide lock so that
``min_production_replicas`` always stay with production. When nothing can be leased the caller
gets a 503 naming each replica's reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies import rendezvous_order
from router.errors import Unavailable
from router.fleet import Fleet, ReplicaState
from router.ledger.keys import Profile
from router.ledger.turns import Turns


@dataclass(frozen=True, slots=True)
class Lease:
    replica: ReplicaState
    reason: str


def unleasable(replica: ReplicaState, serving: Sequence[ReplicaState], minimum: int) -> str | None:
    """Why ``replica`` cannot be leased now (None: it can)."""
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
    if left < minimum:
        return f"leasing it would leave {left} replica(s) to production (minimum {minimum})"
    return None


async def lease(
    fleet: Fleet,
    turns: Turns,
    run: str,
    profile: Profile,
    model: str,
    *,
    ttl_ms: int,
    minimum: int,
    leaving: str | None = None,
    digest: str | None = None,
) -> Lease:
    """The first free replica in the arm's rendezvous order, leased to ``run`` for ``ttl_ms``.
    A run that moves (``router.eval.failover``) passes the replica it is ``leaving`` and the
    engine ``digest`` its history was computed on: only replicas with that digest qualify."""
    reuse = profile.cache != "off"
    serving = fleet.serving(model)
    allowed = [r.id for r in serving if r.settings.reuse == reuse and r.id != leaving]
    if profile.replica is not None:
        allowed = [r for r in allowed if r == profile.replica]
    order = rendezvous_order(profile.name, allowed)
    skipped: list[str] = []
    async with turns.lease_lock():
        marks = await turns.marks(r.id for r in serving)
        for replica in serving:
            replica.leased_by = marks[replica.id][0]
        for rank, replica_id in enumerate(order, 1):
            replica = fleet[replica_id]
            why = unleasable(replica, serving, minimum)
            if digest is not None and replica.engine_digest != digest:
                theirs = replica.engine_digest[:12] or "unknown"
                why = f"engine digest {theirs} differs from the run's {digest[:12]}"
            if why is None:
                holder = await turns.take_lease(replica_id, run, ttl_ms)
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
