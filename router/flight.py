"""A flight: one request admitted to one replica, from its first chunk to its lineage record.

Both dispatchers (production and eval) start flights through :func:`take_off`, the one place
where a replica's load is counted, the backend stream opened and the first chunk awaited; they
differ in what happens when the flight ends (their ``Settler``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.base import BackendError, Chunk, EngineStats, GenerationRequest
from policies import Decision
from router.errors import KvlError, UpstreamFailed
from router.fleet import ReplicaState, Watched
from router.ledger.records import Admission, Outcome, Principal, RecordInput


@dataclass(slots=True)
class Parsed:
    """What a front asked for: the model, the engine request, and how to answer."""

    model: str
    request: GenerationRequest
    echo_prompt: bool = False  # Triton front: exclude_input_in_output false
    episode: str | None = None  # X-Kvl-Episode: aligns eval runs in `kvledger runs diff`


class Settler(Protocol):
    """What a flight reports to when it ends: the production or the eval dispatcher."""

    # True when a cancellation during ``settle`` of a flight that ended well loses nothing (the
    # ledger queues the step it was cancelled in), so the caller need not shield it.
    cancel_safe: bool

    def release(self, flight: Flight) -> None: ...

    async def settle(self, flight: Flight, outcome: Outcome) -> dict[str, Any]: ...


@dataclass
class Flight:
    """One request admitted to one replica; iterate ``chunks()``, then call ``finish()`` once."""

    dispatcher: Settler
    parsed: Parsed
    principal: Principal
    replica: ReplicaState
    decision: Decision
    admission: Admission
    stream: Watched
    first: Chunk
    started: float
    first_chunk_at: float
    record_parts: RecordInput  # made at take-off, its draft computed while the replica works
    failure: Callable[[str], KvlError] = UpstreamFailed  # how a mid-stream failure answers
    finished: bool = False
    pieces: list[str] = field(default_factory=list)
    stats: EngineStats | None = None
    outputs: dict[str, Any] | None = None  # the last engine response's outputs (raw requests)
    context: Any = None  # the eval dispatcher's turn

    async def chunks(self) -> AsyncIterator[Chunk]:
        chunk: Chunk | None = self.first
        while chunk is not None:
            self._take(chunk)
            yield chunk
            chunk = None if chunk.final else await self._next()

    async def collect(self) -> None:
        """Read the flight to its end (a non-streamed answer): ``chunks()`` without a
        generator to resume per chunk."""
        chunk = self.first
        while not self._take(chunk):
            chunk = await self._next()

    def _take(self, chunk: Chunk) -> bool:
        """Keep the chunk's text and statistics; True for the last one."""
        self.pieces.append(chunk.text)
        if chunk.stats is not None:
            self.stats = chunk.stats
        if chunk.outputs is not None:
            self.outputs = chunk.outputs
        return chunk.final

    async def _next(self) -> Chunk:
        try:
            return await anext(self.stream)
        except StopAsyncIteration as exc:
            raise self.failure(f"replica {self.replica.id} ended the stream early") from exc
        except BackendError as exc:
            raise self.failure(str(exc)) from exc

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def record_input(self) -> RecordInput:
        """The parts of this flight a lineage record is made of."""
        return self.record_parts

    @staticmethod
    def parts(
        parsed: Parsed,
        principal: Principal,
        replica: ReplicaState,
        decision: Decision,
        admission: Admission,
    ) -> RecordInput:
        """What a record of ``parsed`` on ``replica`` is made of (also for a request that ended
        before its flight took off)."""
        return RecordInput(  # positional: see backends.base on per-request values
            parsed.request,
            parsed.model,
            parsed.episode,
            principal,
            decision.policy,
            decision.reason,
            replica.tokens_per_block,
            admission,
        )

    async def finish(self, status: str) -> dict[str, Any]:
        """Release the replica, advance its chain, write the lineage record; returns the record."""
        if self.finished:
            raise RuntimeError("finish() called twice")
        self.finished = True
        self.dispatcher.release(self)
        # Not ok: cancels the request inside Triton. Ok: the stream has given its last chunk;
        # closed here it ends now, instead of being finalized later by the event loop (a
        # thread-safe wake-up and a task per request).
        await self.stream.aclose()
        latency_s = time.perf_counter() - self.started
        # status, output, stats, latency_s, first_chunk_s
        outcome = Outcome(
            status, self.text, self.stats, latency_s, self.first_chunk_at - self.started
        )
        return await self.dispatcher.settle(self, outcome)


async def take_off(
    settler: Settler,
    parsed: Parsed,
    principal: Principal,
    replica: ReplicaState,
    decision: Decision,
    admission: Admission,
    *,
    failure: Callable[[str], KvlError] = UpstreamFailed,
) -> Flight:
    """Count the request on the replica, open its stream and wait for the first chunk.

    Whatever the first chunk raises, the replica's count is undone, the stream closed and the
    exception propagates unchanged: the caller decides what it means (fail over, 503, 400).

    The record's request part (its digests) is drafted once the request is on its way: the
    draft is a callback of the next turn of the loop, which runs when this task waits for the
    replica, so its hashing overlaps the replica's work instead of following its answer.
    """
    started = time.perf_counter()
    replica.in_flight += 1
    parts = Flight.parts(parsed, principal, replica, decision, admission)
    stream = replica.watch(replica.backend.stream(parsed.request))  # the no-progress deadline
    stream.loop.call_soon(parts.draft)
    try:
        first = await anext(stream)
    except BaseException:
        replica.in_flight -= 1
        await stream.aclose()
        raise
    now = time.perf_counter()
    return Flight(
        settler,
        parsed,
        principal,
        replica,
        decision,
        admission,
        stream,
        first,
        started,
        now,
        parts,
        failure,
    )
