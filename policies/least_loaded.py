"""Least loaded: the eligible replica with the fewest requests in flight."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Decision, ReplicaView, RequestFeatures, eligible


def least_loaded_order(pool: Sequence[ReplicaView]) -> list[ReplicaView]:
    """``pool`` ranked by load, lightest first; ties broken by id.

    Load is ``(in_flight + 1) / capacity_weight``: the replica's share of work if it takes
    this request. With equal weights that is simply the fewest in flight; counting the new
    request is what lets an idle replica of weight 2 win over an idle one of weight 1.
    """
    return sorted(pool, key=lambda r: ((r.in_flight + 1) / r.capacity_weight, r.id))


def describe_load(replica: ReplicaView) -> str:
    """``"r2 at 3 in flight"``, plus the weight when it is not the default."""
    weight = "" if replica.capacity_weight == 1.0 else f" (weight {replica.capacity_weight:g})"
    return f"{replica.id} at {replica.in_flight} in flight{weight}"


class LeastLoaded:
    """Send each request to the least loaded eligible replica. Stateless: the router's
    in-flight counts are the whole input."""

    name = "least_loaded"
    prefix_blocks = 0  # routes on load (or turn) alone

    def select(self, features: RequestFeatures, replicas: Sequence[ReplicaView]) -> Decision:
        order = least_loaded_order(eligible(replicas))
        return Decision(
            replica=order[0].id,
            policy=self.name,
            reason=f"least_loaded: {describe_load(order[0])}",
            candidates=tuple(r.id for r in order),
        )

    def on_start(self, replica_id: str, features: RequestFeatures, now: float) -> None:
        return None

    def on_finish(self, replica_id: str) -> None:
        return None
