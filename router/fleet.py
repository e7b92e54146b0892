"""The proxy's local view of its replicas: health, load, lease and the generation it knows.

Health has two sources. The monitor's check (readiness and counters, under a short timeout)
marks a replica that does not answer, or is not ready, unhealthy, and healthy again when it
answers. Requests add the other: every stream goes through :meth:`ReplicaState.watch`, which
ends a request that made no progress (no chunk) for ``backend_timeout_s`` by closing its stream,
which cancels it inside the replica, and answers 504. Until its first chunk a request shows
nothing of its own (a prefill; a non-streamed answer, which comes whole), so there the engine's
progress counts too: the monitor's reading that the engine's iteration counter rose while no
request waited in it (every request it held was running, this one too). A request queued behind
another, or on an engine that stopped iterating, still ends after ``backend_timeout_s``; a long
non-streamed answer on an engine with a queue too (nothing tells its progress from a wait).
A replica whose requests time out ``unhealthy_after_timeouts`` times in a row is *stalled*:
unhealthy, so routed around, even while its health API still answers (an engine stuck on one
huge request behind a live server).
The monitor lets it back when the engine holds no request any more (whatever blocked it ended
or was cancelled), or, failing that, after a cool-off of three deadlines (at least 10 s) on
probation: one more timeout and it is stalled again, one chunk and it is trusted again.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field

import structlog

from backends.base import Backend, Chunk, ReplicaCounters
from policies import ReplicaView
from router.deadline import Deadline
from router.errors import GatewayTimeout
from router.settings import ReplicaSettings

_log = structlog.get_logger("kvledger.fleet")


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
    # From the engine's own files (backends.engine_limits), as the runtime computes them.
    engine_max_input_len: int = 0  # the prompt limit (0: not known)
    engine_max_seq_len: int = 0  # past it the output is clamped (0: not known)
    # The served model's declared inputs (name -> Triton data type): the Triton fronts pass
    # through those kvledger does not interpret, after checking their types against these.
    model_inputs: dict[str, str] = field(default_factory=dict)
    counters: ReplicaCounters | None = None
    served: int = 0
    reused_blocks: int = 0
    total_blocks: int = 0
    timeout_s: float = 10.0  # backend_timeout_s: no chunk for this long ends the request
    unhealthy_after: int = 3  # requests timed out in a row before the replica is stalled
    timeouts: int = 0  # requests timed out in a row
    stalled_at: float | None = None  # when timeouts took it out of routing (monotonic clock)
    # When the monitor last saw the engine progress for every request it held (the event
    # loop's clock): the credit of requests still waiting for their first chunk.
    progressed_at: float = -math.inf

    # From ``settings`` (read on every request: attributes, not properties).
    id: str = field(init=False)
    production: bool = field(init=False)  # in the production pool; else eval leases only
    # The KV-cache block size: the engine's config.json once the monitor read it, the config's
    # until then (never a metrics gauge: those read 0 after a load until the first request).
    tokens_per_block: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.settings.id
        self.production = self.settings.pool == "production"
        self.tokens_per_block = self.settings.tokens_per_block

    @property
    def paused(self) -> bool:
        """Taking no new requests: a verified reset is under way."""
        return self.resetting or self.reset_here

    @property
    def takes_production(self) -> bool:
        # generation 0: the monitor has not yet synced the replica with the ledger, so its
        # requests would carry a generation that is not the chain's (and be recorded stale).
        return (
            self.production
            and self.generation > 0
            and self.healthy
            and not self.draining
            and not self.paused
            and self.leased_by is None
        )

    def watch(self, stream: AsyncGenerator[Chunk, None]) -> Watched:
        """``stream`` under the no-progress deadline (see the module docstring)."""
        return Watched(self, stream)

    @property
    def stalled(self) -> bool:
        return self.stalled_at is not None

    def timed_out(self) -> None:
        self.timeouts += 1
        if self.timeouts >= self.unhealthy_after and self.stalled_at is None:
            self.stalled_at, self.healthy = time.monotonic(), False
            _log.warning("replica_stalled", replica=self.id, timeouts=self.timeouts)

    def answered(self, counters: ReplicaCounters, now: float) -> None:
        """The monitor's check succeeded: healthy, unless stalled and still busy."""
        if self.stalled_at is not None:
            cooled = now - self.stalled_at >= max(3 * self.timeout_s, 10.0)
            if counters.active > 0 and not cooled:
                return
            # Idle: trusted again. Cooled off but busy: on probation, one timeout from a stall.
            self.timeouts = 0 if counters.active == 0 else self.unhealthy_after - 1
            self.stalled_at = None
            _log.info("replica_recovered", replica=self.id, active=counters.active)
        self.healthy = True

    def engine_seen(self, before: ReplicaCounters | None, now: ReplicaCounters, at: float) -> None:
        """The monitor's reading at ``at`` (the loop's clock): the engine iterated since the
        last one and no request waits in it, so each request it holds made progress."""
        if before is not None and now.iteration_counter > before.iteration_counter:
            if now.waiting == 0:
                self.progressed_at = at

    def view(self) -> ReplicaView:
        # id, healthy, leased, draining, in_flight, capacity_weight, production (positional:
        # see backends.base on per-request values)
        leased, draining = self.leased_by is not None, self.draining or self.paused
        return ReplicaView(
            self.id, self.healthy, leased, draining, self.in_flight, 1.0, self.production
        )


class Watched:
    """A replica's stream under its no-progress deadline: an async iterator of its chunks
    (``anext``) that ends the request with a 504 when no chunk came for ``timeout_s``, and
    closes the stream (which cancels the request inside the replica) when it ends, fails or is
    closed (``aclose``). Not an async generator: a request's chunks pass through it without a
    generator's frame, loop registration and finalizer."""

    def __init__(self, replica: ReplicaState, stream: AsyncGenerator[Chunk, None]) -> None:
        self._replica = replica
        self._stream = stream
        self._deadline = Deadline(replica.timeout_s, replica)  # credited until a first chunk

    def __aiter__(self) -> Watched:
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the stream runs on (asking asyncio costs a system call)."""
        return self._deadline.loop

    async def __anext__(self) -> Chunk:
        deadline = self._deadline
        deadline.waiting()
        try:
            chunk = await anext(self._stream)
        except BaseException as exc:
            deadline.done()
            # The deadline's cancel, as the backend passed it on (not a client gone).
            timed_out = not isinstance(exc, StopAsyncIteration) and deadline.expired()
            await self.aclose()
            if not timed_out:
                raise
            replica = self._replica
            replica.timed_out()
            raise GatewayTimeout(
                f"replica {replica.id} made no progress for {replica.timeout_s:g} s"
                " (backend_timeout_s); the request was cancelled"
            ) from exc
        deadline.done()
        deadline.credit = None  # from now on, only chunks show progress
        self._replica.timeouts = 0
        return chunk

    async def aclose(self) -> None:
        self._deadline.close()
        await self._stream.aclose()  # a stream still open is cancelled inside the replica


class Fleet:
    """All replicas by id, and those serving one model."""

    def __init__(self, replicas: Mapping[str, ReplicaState]) -> None:
        self._replicas = dict(replicas)
        # Health checks of the whole fleet completed (kvl_monitor_ticks_total): what "one
        # monitor interval later" means, to a test or an operator, without a clock.
        self.monitor_ticks = 0
        # Asked twice a request: made once (the fleet's replicas are fixed at start).
        self._serving: dict[str, tuple[ReplicaState, ...]] = {}
        for replica in self._replicas.values():
            model = replica.settings.model
            self._serving[model] = (*self._serving.get(model, ()), replica)

    def __getitem__(self, replica_id: str) -> ReplicaState:
        return self._replicas[replica_id]

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self._replicas.values())

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def serving(self, model: str) -> tuple[ReplicaState, ...]:
        return self._serving.get(model, ())

    def any_ready(self) -> bool:
        return any(r.healthy for r in self._replicas.values())

    def production_ready(self) -> bool:
        """Some replica could take a production request now."""
        return any(r.takes_production for r in self._replicas.values())
