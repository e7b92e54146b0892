"""Round robin over the eligible replicas, in id order."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Decision, ReplicaView, RequestFeatures, eligible


class RoundRobin:
    """Each request goes to the next eligible replica after the one that last started.

    The cursor is a replica id, not an index, so replicas joining, leaving or turning
    ineligible never make the rotation skip or repeat a healthy replica. It advances in
    ``on_start`` only: ``select`` stays a pure function of the cursor and its arguments.
    """

    name = "round_robin"
    prefix_blocks = 0  # routes on load (or turn) alone

    def __init__(self) -> None:
        self._last_started: str | None = None

    def select(self, features: RequestFeatures, replicas: Sequence[ReplicaView]) -> Decision:
        ids = [r.id for r in eligible(replicas)]
        last = self._last_started
        start = next((n for n, rid in enumerate(ids) if last is not None and rid > last), 0)
        rotation = tuple(ids[start:] + ids[:start])
        after = "first" if last is None else f"next after {last}"
        return Decision(
            replica=rotation[0],
            policy=self.name,
            reason=f"round_robin: {after} -> {rotation[0]}",
            candidates=rotation,
        )

    def on_start(self, replica_id: str, features: RequestFeatures, now: float) -> None:
        self._last_started = replica_id

    def on_finish(self, replica_id: str) -> None:
        # The rotation does not depend on completions.
        return None
