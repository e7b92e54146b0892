"""Failover: an eval run moves off a replica that failed (or is drained) by verified reset and
replay, and goes on exact (DESIGN.md §5, failure semantics).

A move happens under the run's turn on the replica it leaves, so no request of the run runs
meanwhile (the arm's other requests wait in the turn queue, bounded by ``queue_timeout_s``: 503
with ``Retry-After`` past it): lease the next eligible replica of the arm's rendezvous order
with the run's engine digest (``leasing.lease``, the same pool rules), then by cache mode:

- ``reset`` and ``replay:``: a verified reset, then a replay of the run's committed history in
  chain order (the snapshot's requests first, for ``replay:``): every replayed output must equal
  the recorded one, and the fingerprint must reach the run's current state;
- ``off``: wait until the replica is idle (there is nothing to rebuild);
- ``shared``: cannot move (its cache state is not reproducible): the run breaks.

Then the run's turn is taken on the new replica for the request that was waiting, and the old
lease is freed. The run record lists each move (``moves``: when, from, to, why, replayed
requests, seconds). A move that cannot happen fails the run (no replica to lease) or breaks it
(the history cannot replay) with the reason; nothing is served from a state not proven.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
import structlog

from backends.base import BackendError
from router.errors import KvlError, Unavailable
from router.eval import continuity
from router.eval.leasing import lease
from router.eval.profiles import REPLAY, now_iso
from router.eval.replay import serve_one
from router.eval.reset import ResetFailed, wait_idle
from router.eval.runs import Meta, Runs
from router.eval.turns import TurnKeeper
from router.fleet import ReplicaState
from router.ledger import LedgerError
from router.ledger.keys import Profile
from router.ledger.turns import Turn
from router.metrics import Metrics

_log = structlog.get_logger("kvledger.failover")
MOVE_BUDGET_MS = 600_000  # the new lease outlives a move by this much at most
LEASE_WAIT_S = 30.0  # how long a move waits for the monitor to look again at unhealthy replicas
LEASE_POLL_S = 0.1


class Move(Exception):
    """The run's replica failed before this request produced anything: move, then retry."""

    def __init__(self, run: Meta, why: str) -> None:
        super().__init__(why)
        self.run, self.why = run, why


class Rerouted(Exception):
    """The run moved while this request waited for its turn on the old replica."""

    def __init__(self, run: Meta) -> None:
        super().__init__(run["id"])
        self.run = run


def stream_failed(run: str, replica: str, detail: str) -> str:
    return (
        f"run {run}: replica {replica} failed mid-stream ({detail}); failover: the run moves"
        " to another replica by verified reset and replay; retry this request there"
    )


async def gone(replica: ReplicaState) -> bool:
    """The monitor calls the replica unhealthy: is it really not serving? (A check that timed
    out on a busy machine, or a stall, is no reason to move a run.)"""
    if replica.healthy:
        return False
    try:
        return not await replica.backend.ready()
    except BackendError:
        return True


class CannotMove(Exception):
    """Why the run cannot move: the run is broken with that reason (DESIGN: a run that cannot
    move, a ``shared`` arm, no replica with its digest, a replay that does not reproduce)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def moves(meta: Meta) -> list[dict[str, Any]]:
    """The run's moves, oldest first (the run record keeps them as JSON)."""
    raw = meta.get("moves")
    return list(orjson.loads(raw)) if raw else []


def profile_of(meta: Meta) -> Profile:
    """What leasing needs of the arm's key, from the run record."""
    return Profile(
        name=meta["arm"],
        mode="eval",
        cache=meta.get("cache") or "shared",
        replica=meta.get("pinned") or None,
        idle_timeout_s=float(meta.get("idle_timeout_s") or 600),
    )


class Mover:
    """Moves runs for one proxy instance."""

    def __init__(self, runs: Runs, keeper: TurnKeeper, metrics: Metrics) -> None:
        self.runs, self.keeper, self.metrics = runs, keeper, metrics

    async def move(self, run: Meta, why: str, turn: Turn) -> tuple[ReplicaState, Turn]:
        """Move ``run`` (whose turn on its replica ``turn`` is held, and released here) to a new
        replica; the new replica and the run's turn there. 503 with the reason when it cannot."""
        started = time.perf_counter()
        try:
            try:
                replica, timings, meta = await self._move(run, why)
            except CannotMove as exc:
                await self._give_up(run, why, exc, started)
                raise _unavailable(run, f"{why}; it cannot move: {exc.reason}") from exc
            seconds = time.perf_counter() - started
            entry: dict[str, Any] = {"at": now_iso(), "from": run["replica"], "to": replica.id}
            entry.update(why=why, seconds=round(seconds, 3), **timings)
            meta["moves"] = orjson.dumps([*moves(run), entry]).decode()
            # Recorded before the old turn is given back: a request waiting for it then finds
            # the run on its new replica (and follows it) instead of a lease that is gone.
            await self.runs.store.update(run["id"], meta)
            new_turn = await self.keeper.acquire(replica.id, run["id"])
        finally:
            await self.keeper.release(turn)
        self.metrics.moved("moved", seconds)
        _log.warning("run_moved", run=run["id"], **{k: v for k, v in entry.items() if k != "at"})
        return replica, new_turn

    async def move_off(self, replica: str, why: str) -> list[dict[str, Any]]:
        """Move every live run leased on ``replica`` (an admin drain with --move-runs), each
        once its in-flight request ended; per run, its move or why it could not."""
        done: list[dict[str, Any]] = []
        for run_id in await self.runs.store.live():
            meta = await self.runs.store.get(run_id)
            if not meta or meta.get("replica") != replica or meta.get("status") != "live":
                continue
            turn = await self.keeper.acquire(replica, run_id)
            meta = await self.runs.store.get(run_id) or meta
            if meta.get("replica") != replica or meta.get("status") != "live":
                await self.keeper.release(turn)
                continue
            try:
                _, new_turn = await self.move(meta, why, turn)
            except KvlError as exc:
                done.append({"run": run_id, "moved": False, "reason": exc.message})
                continue
            await self.keeper.release(new_turn)
            moved = await self.runs.store.get(run_id) or {}
            done.append({"run": run_id, "moved": True, "move": moves(moved)[-1]})
        return done

    async def _give_up(self, run: Meta, why: str, exc: CannotMove, started: float) -> None:
        self.metrics.moved("broken", time.perf_counter() - started)
        _log.error("run_move_failed", run=run["id"], why=why, reason=exc.reason)
        await self.runs.fail(run["id"], f"{why}; it cannot move: {exc.reason}", "broken")

    async def _move(self, run: Meta, why: str) -> tuple[ReplicaState, dict[str, Any], Meta]:
        cache = run.get("cache", "shared")
        if cache == "shared":
            raise CannotMove("a shared arm's cache state is not reproducible")
        history = await self._history(run) if cache != "off" else []
        runs = self.runs
        replica = await self._lease(run)
        try:
            reset_s, replay_s = await self._rebuild(run, replica, cache, history)
            meta = await self._settle(run, replica, why)
        except BaseException:
            replica.leased_by = None
            with contextlib.suppress(LedgerError):
                await runs.turns.free_lease(replica.id, run["id"])
            raise
        timings = {"replayed": len(history), "reset_s": reset_s, "replay_s": replay_s}
        return replica, timings, meta

    async def _lease(self, run: Meta) -> ReplicaState:
        """The run's next replica. When none can be leased while some replica is called
        unhealthy, the monitor looks again (two ticks, at most ``LEASE_WAIT_S``) before the move
        gives up: a probe that failed once on a busy machine must not end an hours-long run."""
        runs = self.runs
        ticks = runs.fleet.monitor_ticks
        deadline = time.monotonic() + LEASE_WAIT_S
        while True:
            try:
                held = await lease(
                    runs.fleet,
                    runs.turns,
                    run["id"],
                    profile_of(run),
                    run["model"],
                    ttl_ms=MOVE_BUDGET_MS,
                    minimum=runs.settings.min_production_replicas,
                    leaving=run["replica"],
                    digest=run.get("engine_digest") or None,
                )
                return held.replica
            except Unavailable as exc:
                doubtful = [r for r in runs.fleet if not r.healthy and r.id != run["replica"]]
                looked_again = runs.fleet.monitor_ticks - ticks >= 2
                if not doubtful or looked_again or time.monotonic() > deadline:
                    raise CannotMove(exc.message) from exc
            await asyncio.sleep(LEASE_POLL_S)

    async def _history(self, run: Meta) -> list[dict[str, Any]]:
        """What to replay: the snapshot's requests (``replay:``), then the run's own, each of
        which must have completed and continued the chain; else CannotMove."""
        store, base = self.runs.store, []
        cache = run.get("cache", "")
        if cache.startswith(REPLAY):
            snapshot = await store.snapshot(cache[len(REPLAY) :])
            if snapshot is None:
                raise CannotMove(f"its snapshot '{cache[len(REPLAY) :]}' no longer exists")
            base = list(snapshot["requests"])
        expected = run.get("state")  # where the run began (after its reset or snapshot)
        entries = await store.requests(run["id"])
        for i, entry in enumerate(entries, 1):
            label = f"request {i} ({entry.get('request_id')})"
            if entry.get("status") != "ok":
                raise CannotMove(f"its {label} ended {entry.get('status')}: it cannot replay")
            if not entry.get("prompt") and entry.get("prompt") != "":
                raise CannotMove(f"the input of its {label} was not kept")
            if entry.get("state_before") != expected:
                raise CannotMove(f"its {label} does not continue the run's chain")
            expected = entry.get("state_after")
        return base + entries

    async def _rebuild(
        self, run: Meta, replica: ReplicaState, cache: str, history: list[dict[str, Any]]
    ) -> tuple[float, float]:
        """Seconds the reset (or the wait until idle) and the replay took."""
        runs, run_id = self.runs, run["id"]
        try:
            if cache == "off":
                waited = await wait_idle(replica, runs.settle_s, runs.settings.drain_timeout_s)
                return round(waited, 3), 0.0
            reason = f"verified reset: run {run_id} moves from {run['replica']}"
            report = await runs.resets.reset(replica, reason=reason, run=run_id)
            started = time.perf_counter()
            await self._replay(run, replica, history)
            return round(report.total_s, 3), round(time.perf_counter() - started, 3)
        except (ResetFailed, BackendError, LedgerError) as exc:
            raise CannotMove(exc.message if isinstance(exc, ResetFailed) else str(exc)) from exc

    async def _replay(
        self, run: Meta, replica: ReplicaState, history: list[dict[str, Any]]
    ) -> None:
        run_id, arm, n = run["id"], run["arm"], len(history)
        move = len(moves(run)) + 1
        ledger = self.runs.ledger
        for i, entry in enumerate(history, 1):
            reason = f"failover of run {run_id} (move {move}), request {i} of {n}"
            rid = f"{run_id}.move{move}.{i}"
            record = await serve_one(ledger, replica, run_id, arm, entry, rid, reason)
            recorded = entry.get("output_digest")
            if recorded and record["output_digest"] != recorded:
                raise CannotMove(
                    f"replayed request {i} of {n} ({entry.get('request_id')}) gave another output"
                    f" on replica {replica.id} than the one recorded: the engine did not reproduce"
                    " the run's history"
                )
        head = await self.runs.ledger.head(replica.id)
        expected = history[-1].get("state_after") if history else run.get("state")
        if expected and head.state != expected:
            raise CannotMove(
                f"the replay reached state {head.state[:12]}, not the run's {str(expected)[:12]}"
            )

    async def _settle(self, run: Meta, replica: ReplicaState, why: str) -> Meta:
        """The new replica's counter and head become the run's; the old lease is freed."""
        runs, run_id = self.runs, run["id"]
        count = await continuity.settled(replica)
        await runs.turns.set_run_counter(replica.id, run_id, count)
        idle_ms = int(float(run["idle_timeout_s"]) * 1000)
        await runs.turns.renew_lease(replica.id, run_id, idle_ms)
        old = run["replica"]
        with contextlib.suppress(LedgerError):
            await runs.turns.free_lease(old, run_id)
        if old in runs.fleet and runs.fleet[old].leased_by == run_id:
            runs.fleet[old].leased_by = None
        head = await runs.ledger.head(replica.id)
        return {
            "replica": replica.id,
            "generation": str(head.generation),
            "move_pending": "",
        }


def _unavailable(run: Meta, reason: str) -> KvlError:
    return Unavailable(
        f"run {run['id']} broken: {reason}; begin a new run (kvledger runs begin {run['arm']})",
        headers={"Retry-After": "5", "X-Kvl-Run": run["id"]},
    )
