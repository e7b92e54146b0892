"""Dispatch: principal and request → policy → replica → stream → ledger.

Nothing waits on Redis on the way in: the admission carries the generation this proxy knows.
The chain advances once when the request ends, whatever the ending (a cancelled request still
touched the cache), in one Redis call that also writes the record; the record's
``state_before`` is the head that step advanced from. In production a replica that cannot be
reached is skipped for the next candidate, but only while nothing has been streamed.

A request whose bytes reached a replica that then failed without an answer (``written`` on the
backend's error) may have run there: before it moves on, its record (status ``error``) steps
that replica's chain to an unknown state (``Ledger.lost``), and the record of the replica that
then serves it says which one it left and why (``warning``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from backends.base import BackendError, BackendFailed, BackendRejected, BackendUnavailable
from policies import (
    Decision,
    NoReplicaAvailable,
    Policy,
    RequestFeatures,
    prefix_block_hashes,
)
from router.errors import BadRequest, NotFound, Unavailable, UpstreamFailed
from router.fleet import Fleet, ReplicaState
from router.flight import Flight, Parsed, take_off
from router.ledger import Ledger
from router.ledger.records import Admission, Outcome, Principal, RecordInput, make_record
from router.metrics import Metrics

_log = structlog.get_logger("kvledger.dispatch")


class Dispatcher:
    """Routes production requests; owned by the app, one per proxy instance."""

    cancel_safe = True  # settle is one ledger commit (see Ledger.commit) and counters

    def __init__(self, fleet: Fleet, ledger: Ledger, policy: Policy, metrics: Metrics) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.policy = policy
        self.metrics = metrics

    def release(self, flight: Flight) -> None:
        flight.replica.in_flight -= 1
        self.policy.on_finish(flight.replica.id)

    def select(self, parsed: Parsed) -> tuple[Decision, RequestFeatures]:
        serving = self.fleet.serving(parsed.model)
        if not serving:
            raise NotFound(f"model '{parsed.model}' is not served here", param="model")
        views = [r.view() for r in serving]
        tokens_per_block = serving[0].settings.tokens_per_block
        prompt = parsed.request.prompt
        blocks = self.policy.prefix_blocks  # as many as the policy reads, no more
        hashes = prefix_block_hashes(prompt, tokens_per_block, blocks)
        features = RequestFeatures(hashes, len(prompt.encode()), parsed.model)
        try:
            return self.policy.select(features, views), features
        except NoReplicaAvailable as exc:
            raise Unavailable(str(exc), headers={"Retry-After": "1"}) from exc

    async def open(self, parsed: Parsed, principal: Principal) -> Flight:
        """Start the request on the chosen replica, failing over while nothing was streamed."""
        # Every log event of this request's task carries its id and key (contextvars are per task).
        structlog.contextvars.bind_contextvars(
            request_id=parsed.request.request_id, key=principal.name
        )
        decision, features = self.select(parsed)
        failures: list[str] = []
        lost: list[str] = []  # replicas it was written to without an answer
        for replica_id in decision.candidates:
            replica = self.fleet[replica_id]
            if not replica.takes_production:
                continue
            flight = await self._try(parsed, principal, replica, decision, features, failures, lost)
            if flight is not None:
                return flight
        raise Unavailable(
            "no replica could take the request: " + "; ".join(failures or ["none eligible"]),
            headers={"Retry-After": "1"},
        )

    async def _try(
        self,
        parsed: Parsed,
        principal: Principal,
        replica: ReplicaState,
        decision: Decision,
        features: RequestFeatures,
        failures: list[str],
        lost: list[str],
    ) -> Flight | None:
        # The policy learns what went where (and when) before the next request is selected.
        self.policy.on_start(replica.id, features, time.monotonic())
        moved = ("moved after " + "; ".join(lost)) if lost else None
        admission = Admission(replica.id, replica.generation, replica.engine_digest, None, moved)
        started = time.perf_counter()
        try:
            return await take_off(self, parsed, principal, replica, decision, admission)
        except asyncio.CancelledError:
            # The client left before the first chunk; the prefill may still have touched the
            # cache, so the request is recorded (cancelled) and its chain step runs.
            self.policy.on_finish(replica.id)
            waited = time.perf_counter() - started
            outcome = Outcome("cancelled", "", None, waited, waited)
            parts = Flight.parts(parsed, principal, replica, decision, admission)
            await asyncio.shield(self.ledger.commit(make_record(parts, outcome)))
            raise
        except BaseException as exc:
            self.policy.on_finish(replica.id)
            if isinstance(exc, BackendError) and exc.written:
                waited = time.perf_counter() - started
                parts = Flight.parts(parsed, principal, replica, decision, admission)
                reason = await asyncio.shield(self._lost(parts, exc, waited))
                lost.append(reason)
            if isinstance(exc, BackendUnavailable):
                replica.healthy = False  # the monitor brings it back when it answers again
                failures.append(str(exc))
                _log.warning("replica_unavailable", replica=replica.id, error=exc.detail)
                return None
            raise translate(exc) from exc

    async def _lost(self, parts: RecordInput, exc: BackendError, waited: float) -> str:
        """Record a request written to a replica that failed without an answer (see the
        module docstring); returns the reason, which the record carries."""
        reason = (
            f"written to replica {exc.replica}, which failed without an answer ({exc.detail}):"
            " it may have run it, so its cache state is unknown from here"
        )
        outcome = Outcome("error", "", None, waited, waited)
        record = await self.ledger.lost(make_record(parts, outcome), reason)
        _log.warning("request_lost", replica=exc.replica, error=exc.detail, seq=record["seq"])
        return reason

    async def settle(self, flight: Flight, outcome: Outcome) -> dict[str, Any]:
        record = make_record(flight.record_input(), outcome)
        # Counted while the chain step is on its way to Redis (a callback runs when this task
        # waits for it): what is counted does not depend on the step's answer.
        flight.stream.loop.call_soon(account, self.metrics, flight.replica, record, outcome)
        return await self.ledger.commit(record)


def account(
    metrics: Metrics, replica: ReplicaState, record: dict[str, Any], outcome: Outcome
) -> None:
    metrics.observe(record, outcome.latency_s)
    replica.served += 1
    replica.reused_blocks += int(record["reused_blocks"])
    replica.total_blocks += int(record["total_blocks"])


def translate(exc: BaseException) -> BaseException:
    if isinstance(exc, BackendRejected):
        return BadRequest(f"the replica rejected the request: {exc.detail}")
    if isinstance(exc, BackendFailed):
        return UpstreamFailed(str(exc))
    return exc
