"""Eval requests: the arm's run, its leased replica, one request at a time, each verified.

A request of an eval key finds its arm's run (``runs``), waits for its turn on the run's leased
replica (``turns``), checks that the run still holds its lease and reads the replica's request
counter (``continuity``), runs while a keeper renews the turn, the lease and the arm's pointer,
and advances the chain under its fence token, so the chain order is the cache's order. A run
that loses its lease or its turn, or whose chain step had to wait for Redis, is *broken*: the
request's record says so (``exact: false``, ``verified: false``, the reason in ``warning``) and
the run's later requests answer 503 with the reason. A run whose replica fails (or was drained
with --move-runs) moves under the waiting request's turn (``failover``), which then goes on at
the new replica. Eval requests fail closed: no Redis, no run, 503.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog

from backends.base import BackendError, BackendRejected, BackendUnavailable
from policies import Decision
from router.dispatch import account, translate
from router.errors import BadRequest, GatewayTimeout, KvlError, Unavailable
from router.eval import continuity
from router.eval.failover import Move, Mover, Rerouted, gone, moves, stream_failed
from router.eval.runs import Meta, Runs
from router.eval.turns import Keeping, TurnKeeper
from router.fleet import Fleet, ReplicaState
from router.flight import Flight, Parsed, take_off
from router.ledger import Ledger, LedgerError
from router.ledger.core import Fence
from router.ledger.records import Admission, Outcome, Principal, RecordInput, make_record
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
    keeping: Keeping
    count_after: int = -1


def _no_redis(exc: LedgerError) -> Unavailable:
    return Unavailable(
        f"eval requests need Redis, which is unreachable, to hold the run's lease: {exc}",
        headers={"Retry-After": "1"},
    )


class EvalDispatcher:
    cancel_safe = False  # settle holds the run's turn: a cancelled one must still finish

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
        self.keeper = TurnKeeper(turns, runs.store, settings)
        self.mover = Mover(runs, self.keeper, metrics)

    async def open(self, parsed: Parsed, principal: Principal) -> Flight:
        structlog.contextvars.bind_contextvars(
            request_id=parsed.request.request_id, key=principal.name
        )
        assert principal.profile is not None  # authenticate() sets it for eval keys
        try:
            run = await self.runs.for_request(principal.profile, parsed.model)
            replica = self._replica(parsed, run)
            turn = await self.keeper.acquire(replica.id, run["id"])
        except LedgerError as exc:
            raise _no_redis(exc) from exc
        return await self._open_on(parsed, principal, replica, turn, run["id"])

    async def _open_on(
        self, parsed: Parsed, principal: Principal, replica: ReplicaState, turn: Turn, run: str
    ) -> Flight:
        """Start under ``turn``; a run whose replica failed first moves (``failover``), under
        the same turn, and the request goes on at the new replica; a run that moved while this
        request waited sends it after the run, to the new replica's queue."""
        for _ in range(3):
            try:
                try:
                    return await self._start(parsed, principal, replica, turn, run)
                except Move as move:
                    replica, turn = await self.mover.move(move.run, move.why, turn)
                except Rerouted as moved:
                    await self.keeper.release(turn)
                    replica = self._replica(parsed, moved.run)
                    turn = await self.keeper.acquire(replica.id, run)
            except LedgerError as exc:
                raise _no_redis(exc) from exc
        await asyncio.shield(self.keeper.release(turn))
        raise Unavailable(f"run {run} keeps moving; retry", headers={"Retry-After": "5"})

    async def _start(
        self,
        parsed: Parsed,
        principal: Principal,
        replica: ReplicaState,
        turn: Turn,
        turn_run: str,
    ) -> Flight:
        try:
            return await self._started(parsed, principal, replica, turn, turn_run)
        except (Move, Rerouted):
            raise  # the turn stays held: the move happens under it
        except BaseException:
            await asyncio.shield(self.keeper.release(turn))
            raise

    def _replica(self, parsed: Parsed, run: Meta) -> ReplicaState:
        if parsed.model != run["model"]:
            raise BadRequest(
                f"run {run['id']} serves model '{run['model']}'; end it or begin a new run"
                f" to use '{parsed.model}'",
                param="model",
            )
        if run["replica"] not in self.fleet:
            raise Unavailable(
                f"run {run['id']} holds replica {run['replica']}, which this proxy instance"
                " is not configured with; send its requests to one that is, or move the run"
                f" here (kvledger replicas drain {run['replica']} --move-runs)",
                headers=_RETRY,
            )
        return self.fleet[run["replica"]]

    async def _started(
        self,
        parsed: Parsed,
        principal: Principal,
        replica: ReplicaState,
        turn: Turn,
        turn_run: str,
    ) -> Flight:
        # The run may have failed, ended or moved while this request waited for its turn.
        run = await self.runs.still_live(turn_run, principal.name)
        if run["replica"] != replica.id:
            raise Rerouted(run)
        if run.get("move_pending") or await gone(replica):
            raise Move(run, run.get("move_pending") or f"replica {replica.id} is not ready")
        await self._check_lease(run, replica)
        # Hold turn, lease and arm pointer from here on: a long prefill must not outlive them.
        hold_ms = int(float(run["idle_timeout_s"]) * 1000)
        keeping = self.keeper.keep(turn, run["id"], run["arm"], hold_ms)
        try:
            flight = await self._take_off(parsed, principal, replica, turn, run)
        except BaseException:
            keeping.stop()
            raise
        flight.context.keeping = keeping
        return flight

    async def _take_off(
        self, parsed: Parsed, principal: Principal, replica: ReplicaState, turn: Turn, run: Meta
    ) -> Flight:
        head = await self.ledger.head(replica.id)
        count, stops = await self._count(replica, run), continuity.stops_sent(replica)
        before = continuity.admitted(turn, run["id"], replica.id, count, stops)
        admission = Admission(
            replica.id,
            head.generation,
            head.engine_digest,
            run=run["id"],
            warning=before.warning,
            seq=head.seq,
            state=head.state,
        )
        decision = Decision(replica.id, "eval", run.get("choice", ""), (replica.id,))
        try:
            flight = await take_off(
                self,
                parsed,
                principal,
                replica,
                decision,
                admission,
                failure=lambda m: Unavailable(stream_failed(run["id"], replica.id, m)),
            )
        except BaseException as exc:
            # Written without an answer, or no progress past backend_timeout_s: the run moves.
            timed_out = isinstance(exc, GatewayTimeout)
            if timed_out or (isinstance(exc, BackendError) and exc.written):
                parts = Flight.parts(parsed, principal, replica, decision, admission)
                detail = exc.message if isinstance(exc, KvlError) else str(exc)
                lost = self._lost(run, parts, replica.id, detail)
                raise await asyncio.shield(lost) from exc
            raise await self._first_failed(run, replica, exc) from exc
        flight.context = EvalTurn(run, turn, before, Keeping())
        return flight

    async def _check_lease(self, run: Meta, replica: ReplicaState) -> None:
        holder = (await self.turns.marks([replica.id]))[replica.id][0]
        if holder != run["id"]:
            reason = f"lost its lease on replica {replica.id} (now held by {holder or 'nobody'})"
            await self.runs.fail(run["id"], reason, status="broken")
            raise Unavailable(
                f"run {run['id']} broken: {reason}; begin a new run"
                f" (kvledger runs begin {run['arm']})",
                headers={"Retry-After": "5", "X-Kvl-Run": run["id"]},
            )

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

    async def _lost(self, run: Meta, parts: RecordInput, replica: str, detail: str) -> Move:
        """The request was written to the run's replica, which failed without an answer: it
        may have run there unrecorded, so the replica's state is unknown from here (its record,
        failed, steps the chain there, ``Ledger.lost``) and the run moves; the request is
        retried at the new replica."""
        reason = (
            f"its request {parts.request.request_id} was written to replica {replica},"
            f" which failed without an answer ({detail}): the replica may have run it,"
            " so its cache state is unknown from here"
        )
        outcome = Outcome("error", "", None, 0.0, 0.0)
        record = make_record(parts, outcome)
        record["failover"] = "its replica failed; retried after the run moved"
        await self.ledger.lost(record, reason)
        return Move(run, f"replica {replica} failed without an answer ({detail})")

    async def _count(self, replica: ReplicaState, run: Meta) -> int:
        try:
            return await replica.backend.request_count()
        except BackendError as exc:
            raise await self._replica_failed(run, replica, exc) from exc

    async def _replica_failed(self, run: Meta, replica: ReplicaState, exc: Exception) -> Move:
        return Move(run, f"replica {replica.id} failed mid-run: {exc}")

    def release(self, flight: Flight) -> None:
        flight.replica.in_flight -= 1

    async def settle(self, flight: Flight, outcome: Outcome) -> dict[str, Any]:
        ctx: EvalTurn = flight.context
        ctx.keeping.stop()
        record = make_record(flight.record_input(), outcome)
        if ctx.run.get("moves"):  # the run moved: its records say after which move
            record["move"] = len(moves(ctx.run))
        try:
            await self._verify(flight, ctx, record, outcome)
            record = await self._commit(flight, ctx, record)
        finally:
            await self.keeper.release(ctx.turn)
        account(self.metrics, flight.replica, record, outcome)
        return record

    async def _verify(
        self, flight: Flight, ctx: EvalTurn, record: dict[str, Any], outcome: Outcome
    ) -> None:
        """Did exactly this one request complete on the replica while it ran?"""
        replica, run = flight.replica, ctx.run["id"]
        wait_s = self.settings.continuity_wait_s
        ctx.count_after = await continuity.counted(replica, ctx.before, wait_s)
        stops = continuity.stops_sent(replica) - ctx.before.stops
        record["verified"], record["warning"] = continuity.verdict(
            replica.id, run, ctx.before, ctx.count_after, stops
        )
        if ctx.keeping.lost is not None:
            record.update(verified=False, warning=f"run broken: {ctx.keeping.lost}")
        if outcome.status == "error" and not await replica.backend.ready():
            record["failover"] = f"replica {replica.id} failed mid-run; the run moves"
            await self.runs.store.update(run, {"move_pending": record["failover"]})

    async def _commit(
        self, flight: Flight, ctx: EvalTurn, record: dict[str, Any]
    ) -> dict[str, Any]:
        """The fenced chain step with the record; a run whose order broke is marked broken."""
        run = ctx.run
        fence = Fence(ctx.turn.token, run["id"], ctx.count_after)
        try:
            exact = ctx.keeping.lost is None
            record = await self.ledger.fenced_commit(record, fence, exact=exact)
        except LedgerError as exc:
            reason = f"its chain step had to wait for Redis ({exc})"
            record.update(verified=False, warning=f"run broken: {reason}")
            await self.runs.fail(run["id"], reason, status="broken")
            return self.ledger.defer(record, False, tried=True)
        broken = ctx.keeping.lost
        if record.get("durable") is False:
            broken = await self._not_durable(run, record) or broken
        if record["unordered"]:
            broken = "lost the run's turn (it expired): the chain order is no longer the cache's"
            record.update(verified=False, warning=f"run broken: {broken}")
            _log.error("eval_turn_lost", run=run["id"], replica=flight.replica.id)
        if broken is not None:
            await self.runs.fail(run["id"], broken, status="broken")
            return record
        if record.get("failover"):  # its retry, after the move, is the run's request
            return record
        try:
            await self._remember(flight, run, record)
        except LedgerError as exc:
            reason = f"its request's input could not be kept ({exc})"
            await self.runs.fail(run["id"], reason, status="broken")
        return record

    async def _not_durable(self, run: Meta, record: dict[str, Any]) -> str | None:
        """A record no replica acknowledged within ``durable_wait_ms``: the run says so (its
        ``not_durable`` field, the request's id), and is broken when ``break_on_not_durable``
        (the reason returned)."""
        reason = f"record {record['request_id']} not acknowledged by a Redis replica in time"
        _log.warning("eval_record_not_durable", run=run["id"], request_id=record["request_id"])
        if self.settings.break_on_not_durable:
            record.update(verified=False, warning=f"run broken: {reason}")
            return reason
        record["warning"] = reason
        try:
            await self.runs.store.update(run["id"], {"not_durable": str(record["request_id"])})
        except LedgerError:
            pass  # the record itself says durable: false
        return None

    async def _remember(self, flight: Flight, run: Meta, record: dict[str, Any]) -> None:
        """Keep the request's input (for snapshots and explain) and hold the run for another
        idle timeout."""
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
                "output": flight.text,  # shown by the /ui/ page and `kvledger export`
                "verified": record["verified"],
            },
        )
        idle_ms = int(float(run["idle_timeout_s"]) * 1000)
        held = await self.runs.store.touch(run["arm"], run["id"], idle_ms)
        held = held and await self.turns.renew_lease(flight.replica.id, run["id"], idle_ms)
        if not held:
            await self.runs.fail(run["id"], "lost its lease or its arm pointer", status="broken")
