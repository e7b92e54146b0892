"""The proxy's local view of its replicas: health, load, lease and the generation it knows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from backends.base import Backend, ReplicaCounters
from policies import ReplicaView
from router.settings import ReplicaSettings


@dataclass
class ReplicaState:
    """Mutable, owned by the app: the monitor writes health and generation, dispatch load."""

    settings: ReplicaSettings
    backend: Backend
    healthy: bool = False
    draining: bool = False
    resetting: bool = False  # Redis marks a verified reset under way (any proxy's)
    reset_here: bool = False  # this proxy is resetting it
    leased_by: str | None = None
    in_flight: int = 0
    generation: int = 0
    engine_digest: str = ""
    counters: ReplicaCounters | None = None
    served: int = 0
    reused_blocks: int = 0
    total_blocks: int = 0

    @property
    def id(self) -> str:
        return self.settings.id

    @property
    def paused(self) -> bool:
        """Taking no new requests: a verified reset is under way."""
        return self.resetting or self.reset_here

    @property
    def production(self) -> bool:
        """In the production pool (``settings.pool``); the others serve eval leases only."""
        return self.settings.pool == "production"

    @property
    def takes_production(self) -> bool:
        return (
            self.production
            and self.healthy
            and not self.draining
            and not self.paused
            and self.leased_by is None
        )

    def view(self) -> ReplicaView:
        return ReplicaView(
            id=self.id,
            healthy=self.healthy,
            leased=self.leased_by is not None,
            draining=self.draining or self.paused,
            in_flight=self.in_flight,
            production=self.production,
        )


class Fleet:
    """All replicas by id, with the views a policy sees for one model."""

    def __init__(self, replicas: Mapping[str, ReplicaState]) -> None:
        self._replicas = dict(replicas)

    def __getitem__(self, replica_id: str) -> ReplicaState:
        return self._replicas[replica_id]

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self._replicas.values())

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def serving(self, model: str) -> list[ReplicaState]:
        return [r for r in self._replicas.values() if r.settings.model == model]

    def views(self, model: str) -> list[ReplicaView]:
        return [r.view() for r in self.serving(model)]

    def any_ready(self) -> bool:
        return any(r.healthy for r in self._replicas.values())

    def production_ready(self) -> bool:
        """Some replica could take a production request now."""
        return any(r.takes_production for r in self._replicas.values())
