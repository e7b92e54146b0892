"""Eval requests: the arm's run, its leased replica, one request at a time, each verified.

A request of an eval key finds its arm's run (``runs``), waits for its turn on the run's leased
replica (``turns``), checks the replica's request counter (``continuity``), runs, and advances
the chain under its fence token, so the chain order is the cache's order. Eval requests fail
closed: no Redis, no run, 503.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog

from backends.base import BackendError, BackendRejected, BackendUnavailable
from policies import Decision
from router.dispatch import account, translate
from router.errors import BadRequest, KvlError, Unavailable
from router.eval import continuity
from router.eval.runs import Meta, Runs
from router.eval.turns import TurnKeeper
from router.fleet import Fleet, ReplicaState
from router.flight import Flight, Parsed, take_off
from router.ledger import Ledger, LedgerError
from router.ledger.records import Admission, Outcome, Principal, make_record
from router.ledger.turns import Turn, Turns
from router.metrics import Metrics
from router.settings import EvalSettings

_RETRY = {"Retry-After": "1"}
_log = structlog.get_logger("kvledger.eval")


@dataclass
class EvalTurn:
    """What an eval flight carries besides the request: its run, turn and counter."""

    run: Meta
    turn: Turn
    before: continuity.Before
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
        self.keeper = TurnKeeper(turns, settings)

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
            turn = await self.keeper.acquire(replica.id, run["id"])
        except LedgerError as exc:
            raise _no_redis(exc) from exc
        try:
            return await self._start(parsed, principal, replica, turn, run["id"])
        except BaseException as exc:
            await asyncio.shield(self.keeper.release(turn))
            if isinstance(exc, LedgerError):
                raise _no_redis(exc) from exc
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
        before = continuity.admitted(turn, run["id"], replica.id, await self._count(replica, run))
        admission = Admission(
            replica.id,
            head.generation,
            head.seq,
            head.state,
            head.engine_digest,
            False,
            run=run["id"],
            warning=before.warning,
        )
        decision = Decision(replica.id, "eval", run.get("choice", ""), (replica.id,))
        done: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        done.set_result(admission)
        try:
            flight = await take_off(
                self,
                parsed,
                principal,
                replica,
                decision,
                done,
                failure=lambda m: Unavailable(f"run {run['id']}: {m}"),
            )
        except BaseException as exc:
            raise await self._first_failed(run, replica, exc) from exc
        flight.context = EvalTurn(run, turn, before, self.keeper.keep(turn))
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
        record = make_record(flight.record_input(admission), outcome)
        try:
            await self._verify(flight, ctx, record, outcome)
            await self._commit(flight, ctx, record)
        except LedgerError as exc:
            record.update(verified=False, warning=f"Redis unreachable; chain step deferred: {exc}")
            self.ledger.submit_pending(record)
        finally:
            ctx.renewing.cancel()
            await self.keeper.release(ctx.turn)
        account(self.metrics, flight.replica, record, outcome)
        return record

    async def _verify(
        self, flight: Flight, ctx: EvalTurn, record: dict[str, Any], outcome: Outcome
    ) -> None:
        """Did exactly this one request complete on the replica while it ran?"""
        replica, run = flight.replica, ctx.run["id"]
        wait_s = self.settings.continuity_wait_s
        ctx.count_after = await continuity.counted(replica, ctx.before.count, wait_s)
        record["verified"], record["warning"] = continuity.verdict(
            replica.id, run, ctx.before, ctx.count_after
        )
        if outcome.status == "error" and not await replica.backend.ready():
            await self.runs.fail(run, f"replica {replica.id} failed mid-run")

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
