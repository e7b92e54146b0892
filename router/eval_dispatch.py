"""Eval requests: the arm's run, its leased replica, one request at a time, each verified.

A request of an eval key joins its run's queue on the leased replica (``ledger_turns``), waits
for its turn in arrival order (across proxy instances), reads the chain head and the replica's
request counter, runs, reads the counter again and advances the chain under its fence token.
Continuity: the counter must equal its value after the run's previous request when this one
is admitted, and be one more when it ends; otherwise another request touched the cache and the
record says ``verified: false`` with a ``warning`` (also the ``X-Kvl-Warning`` header when it is
known before the response starts). Eval requests fail closed: no Redis, no run, 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import structlog

from backends.base import BackendError, BackendRejected, BackendUnavailable
from policies import Decision
from router.dispatch import Flight, account, translate
from router.errors import BadRequest, KvlError, Unavailable
from router.fleet import Fleet, ReplicaState
from router.ledger import Ledger, LedgerError
from router.ledger_turns import Turn, TurnLost, Turns
from router.lineage import Admission, Outcome, Principal, build_record
from router.metrics import Metrics
from router.parse import Parsed
from router.runs import Meta, Runs
from router.settings import EvalSettings

_RETRY = {"Retry-After": "1"}
WAITER_TTL_MS = 10_000  # a waiting request refreshes its ticket far more often than this
_log = structlog.get_logger("kvledger.eval")


@dataclass
class EvalTurn:
    run: Meta
    turn: Turn
    count_before: int
    renewing: asyncio.Task[None]
    count_after: int = -1


def _no_redis(exc: LedgerError) -> Unavailable:
    return Unavailable(
        f"eval requests need Redis, which is unreachable, to hold the run's lease: {exc}",
        headers={"Retry-After": "1"},
    )


class EvalDispatcher:
    def __init__(
        self,
        fleet: Fleet,
        ledger: Ledger,
        runs: Runs,
        turns: Turns,
        settings: EvalSettings,
        metrics: Metrics,
    ) -> None:
        self.fleet, self.ledger, self.runs, self.turns = fleet, ledger, runs, turns
        self.settings = settings
        self.metrics = metrics
        self._released: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def open(self, parsed: Parsed, principal: Principal) -> Flight:
        structlog.contextvars.bind_contextvars(
            request_id=parsed.request.request_id, key=principal.name
        )
        assert principal.profile is not None  # authenticate() sets it for eval keys
        try:
            run = await self.runs.for_request(principal.profile, parsed.model)
            if parsed.model != run["model"]:
                raise BadRequest(
                    f"run {run['id']} serves model '{run['model']}'; end it or begin a new run"
                    f" to use '{parsed.model}'",
                    param="model",
                )
            if run["replica"] not in self.fleet:
                raise Unavailable(
                    f"run {run['id']} holds replica {run['replica']}, which this proxy instance"
                    " is not configured with; send its requests to one that is",
                    headers=_RETRY,
                )
            replica = self.fleet[run["replica"]]
            turn = await self._acquire(replica, run)
        except LedgerError as exc:
            raise _no_redis(exc) from exc
        try:
            return await self._start(parsed, principal, replica, turn, run["id"])
        except BaseException as exc:
            await asyncio.shield(self._release(turn))
            if isinstance(exc, LedgerError):
                raise _no_redis(exc) from exc
            raise

    async def _acquire(self, replica: ReplicaState, run: Meta) -> Turn:
        """Wait for this request's turn on the run's replica, in arrival order."""
        ticket = await self.turns.enqueue(replica.id, WAITER_TTL_MS)
        turn_ms = int(self.settings.turn_ttl_s * 1000)
        deadline = time.monotonic() + self.settings.queue_timeout_s
        delay = 0.002
        try:
            while True:
                try:
                    turn = await self.turns.try_acquire(replica.id, ticket, WAITER_TTL_MS, turn_ms)
                except TurnLost:
                    ticket = await self.turns.enqueue(replica.id, WAITER_TTL_MS)
                    continue
                if turn is not None:
                    return turn
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"waited {self.settings.queue_timeout_s:g} s for a turn in run"
                        f" {run['id']}; its requests are served one at a time",
                        headers={"Retry-After": "5", "X-Kvl-Run": run["id"]},
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released[replica.id].wait(), delay)
                delay = min(delay * 2, 0.05)
        except BaseException:
            with contextlib.suppress(LedgerError):
                await asyncio.shield(self.turns.release(replica.id, ticket))
            raise

    async def _start(
        self,
        parsed: Parsed,
        principal: Principal,
        replica: ReplicaState,
        turn: Turn,
        turn_run: str,
    ) -> Flight:
        # The run may have failed or ended while this request waited for its turn.
        run = await self.runs.still_live(turn_run, principal.name)
        head = await self.ledger.head(replica.id)
        count = await self._count(replica, run)
        warning = None
        if turn.run != run["id"]:
            warning = f"continuity unknown: no request counter recorded for run {run['id']}"
        elif count != turn.count:
            warning = _continuity_warning(replica.id, run["id"], count - turn.count)
        admission = Admission(
            replica.id,
            head.generation,
            head.seq,
            head.state,
            head.engine_digest,
            False,
            run=run["id"],
            warning=warning,
        )
        decision = Decision(replica.id, "eval", run.get("choice", ""), (replica.id,))
        started = time.perf_counter()
        replica.in_flight += 1
        stream = replica.backend.stream(parsed.request)
        try:
            first = await anext(stream)
        except BaseException as exc:
            replica.in_flight -= 1
            await stream.aclose()
            raise await self._first_failed(run, replica, exc) from exc
        done: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        done.set_result(admission)
        flight = Flight(
            self,
            parsed,
            principal,
            replica,
            decision,
            done,
            stream,
            first,
            started,
            time.perf_counter(),
            failure=lambda m: Unavailable(f"run {run['id']}: {m}"),
        )
        flight.context = EvalTurn(run, turn, count, asyncio.create_task(self._renew(turn)))
        return flight

    async def _first_failed(
        self, run: Meta, replica: ReplicaState, exc: BaseException
    ) -> BaseException:
        if isinstance(exc, BackendRejected):
            return BadRequest(f"the replica rejected the request: {exc.detail}")
        if isinstance(exc, BackendUnavailable) or (
            isinstance(exc, BackendError) and not await replica.backend.ready()
        ):
            return await self._replica_failed(run, replica, exc)
        return translate(exc)

    async def _count(self, replica: ReplicaState, run: Meta) -> int:
        try:
            return await replica.backend.request_count()
        except BackendError as exc:
            raise await self._replica_failed(run, replica, exc) from exc

    async def _replica_failed(self, run: Meta, replica: ReplicaState, exc: Exception) -> KvlError:
        reason = f"replica {replica.id} failed mid-run: {exc}"
        await self.runs.fail(run["id"], reason)
        return Unavailable(
            f"run {run['id']} failed: {reason}; its lease is released. Begin a new run"
            f" (kvledger runs begin {run['arm']})",
            headers={"Retry-After": "5", "X-Kvl-Run": run["id"]},
        )

    def release(self, flight: Flight) -> None:
        flight.replica.in_flight -= 1

    async def settle(self, flight: Flight, outcome: Outcome) -> dict[str, Any]:
        ctx: EvalTurn = flight.context
        admission = await flight.admission()
        record = build_record(flight, admission, outcome)
        try:
            await self._verify(flight, ctx, record, outcome)
            await self._commit(flight, ctx, record)
        except LedgerError as exc:
            record.update(verified=False, warning=f"Redis unreachable; chain step deferred: {exc}")
            self.ledger.submit_pending(record)
        finally:
            await self._release(ctx.turn)
            ctx.renewing.cancel()
        account(self.metrics, flight.replica, record, outcome)
        return record

    async def _verify(
        self, flight: Flight, ctx: EvalTurn, record: dict[str, Any], outcome: Outcome
    ) -> None:
        """Did exactly this one request complete on the replica while it ran?"""
        replica, before = flight.replica, ctx.count_before
        after = before
        deadline = time.monotonic() + self.settings.continuity_wait_s
        with contextlib.suppress(BackendError):
            # Triton counts a request a moment after its last response: wait for it.
            while (after := await replica.backend.request_count()) <= before:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.005)
        ctx.count_after = after
        record["verified"] = record["warning"] is None and after == before + 1
        if record["warning"] is None and not record["verified"]:
            record["warning"] = _continuity_warning(replica.id, ctx.run["id"], after - before - 1)
        if outcome.status == "error" and not await replica.backend.ready():
            await self.runs.fail(ctx.run["id"], f"replica {replica.id} failed mid-run")

    async def _commit(self, flight: Flight, ctx: EvalTurn, record: dict[str, Any]) -> None:
        run = ctx.run
        step = await self.turns.fenced_advance(
            ctx.turn, record["generation"], record["digest"], run["id"], ctx.count_after
        )
        if step is None:
            record.update(exact=False, verified=False, warning="lost the run's turn (expired)")
            _log.error("eval_turn_lost", run=run["id"], replica=flight.replica.id)
        else:
            record.update(state_after=step.state_after, exact=not step.stale)
        request = flight.parsed.request
        await self.runs.store.add_request(
            run["id"],
            {
                "request_id": request.request_id,
                "model": flight.parsed.model,
                "prompt": request.prompt,
                "params": request.sampling(),
                "status": record["status"],
                "seq": record["seq"],
                "state_before": record["state_before"],
                "state_after": record["state_after"],
                "output_digest": record["output_digest"],
                "verified": record["verified"],
            },
        )
        self.ledger.submit(record)
        idle_ms = int(float(run["idle_timeout_s"]) * 1000)
        await self.runs.store.touch(run["arm"], run["id"], idle_ms)
        await self.turns.renew_lease(flight.replica.id, run["id"], idle_ms)

    async def _release(self, turn: Turn) -> None:
        with contextlib.suppress(LedgerError):
            await self.turns.release(turn.replica, turn.ticket, turn.token)
        event = self._released.pop(turn.replica, None)
        if event is not None:
            event.set()  # wake this proxy's waiters at once; others poll

    async def _renew(self, turn: Turn) -> None:
        ttl_ms = int(self.settings.turn_ttl_s * 1000)
        with contextlib.suppress(LedgerError):
            while True:
                await asyncio.sleep(self.settings.turn_ttl_s / 3)
                await self.turns.renew_turn(turn, ttl_ms)


def _continuity_warning(replica: str, run: str, others: int) -> str:
    if others < 0:
        return f"continuity broken: replica {replica}'s request counter went back (reloaded?)"
    return (
        f"continuity broken: replica {replica} served {others} request(s) outside run {run}"
        " since the run's previous request"
    )
