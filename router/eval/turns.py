"""One request at a time: waiting for a turn on a leased replica, keeping it, giving it back.

A request of a run takes a ticket in the replica's queue (``router.ledger.turns``) and waits
until its ticket is at the head and nobody holds the turn, in arrival order across proxy
instances. While it runs, a keeper renews, together, the turn (its fence token's expiry), the
run's lease on the replica and the arm's pointer to the run, so a request longer than the
arm's idle timeout keeps all three; a renewal that finds one of them gone is remembered
(``Keeping.lost``): the run can no longer vouch that nothing else touched the cache. When the
request ends, the turn is released and this proxy's waiters on that replica are woken at once
(other proxies' waiters poll).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

from router.errors import Unavailable
from router.ledger import LedgerError
from router.ledger.runs import RunStore
from router.ledger.turns import Turn, TurnLost, Turns
from router.settings import EvalSettings

WAITER_TTL_MS = 10_000  # a waiting request refreshes its ticket far more often than this


class TurnKeeper:
    """Queueing and the turn's lifetime; one per proxy instance."""

    def __init__(self, turns: Turns, store: RunStore, settings: EvalSettings) -> None:
        self.turns = turns
        self.store = store
        self.settings = settings
        self._released: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def acquire(self, replica: str, run: str) -> Turn:
        """Wait for this request's turn on ``replica``, in arrival order; 503 after
        ``queue_timeout_s``. LedgerError when Redis fails."""
        ticket = await self.turns.enqueue(replica, WAITER_TTL_MS)
        turn_ms = int(self.settings.turn_ttl_s * 1000)
        deadline = time.monotonic() + self.settings.queue_timeout_s
        delay = 0.002
        try:
            while True:
                try:
                    turn = await self.turns.try_acquire(replica, ticket, WAITER_TTL_MS, turn_ms)
                except TurnLost:
                    ticket = await self.turns.enqueue(replica, WAITER_TTL_MS)
                    continue
                if turn is not None:
                    return turn
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"waited {self.settings.queue_timeout_s:g} s for a turn in run"
                        f" {run}; its requests are served one at a time",
                        headers={"Retry-After": "5", "X-Kvl-Run": run},
                    )
                # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation
                # that arrives as the wait ends, and this request would go on without its client.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._released[replica].wait()
                delay = min(delay * 2, 0.05)
        except BaseException:
            with contextlib.suppress(LedgerError):
                await asyncio.shield(self.turns.release(replica, ticket))
            raise

    def keep(self, turn: Turn, run: str, arm: str, hold_ms: int) -> Keeping:
        """Renew the turn, the lease and the arm's pointer while the request runs (each for
        ``hold_ms``, the arm's idle timeout, at least); ``stop()`` it when the request ends."""
        keeping = Keeping()
        every_s = min(self.settings.turn_ttl_s, hold_ms / 1000) / 3
        keeping.task = asyncio.create_task(
            self._renew(keeping, turn, (run, arm), hold_ms, every_s),
            name=f"kvl-turn-{turn.replica}",
        )
        return keeping

    async def release(self, turn: Turn) -> None:
        """Give the turn back and wake this proxy's waiters; never raises for Redis."""
        with contextlib.suppress(LedgerError):
            await self.turns.release(turn.replica, turn.ticket, turn.token)
        event = self._released.pop(turn.replica, None)
        if event is not None:
            event.set()

    async def _renew(
        self, keeping: Keeping, turn: Turn, owner: tuple[str, str], hold_ms: int, every_s: float
    ) -> None:
        run, arm = owner
        turn_ms = int(self.settings.turn_ttl_s * 1000)
        while keeping.lost is None:
            await asyncio.sleep(every_s)
            try:
                if not await self.turns.renew_turn(turn, turn_ms):
                    keeping.lost = "lost the run's turn (it expired)"
                elif not await self.turns.renew_lease(turn.replica, run, hold_ms):
                    keeping.lost = f"lost the run's lease on replica {turn.replica}"
                elif not await self.store.touch(arm, run, hold_ms):
                    keeping.lost = "the arm no longer points at the run (it expired or moved)"
            except LedgerError as exc:
                keeping.lost = f"Redis unreachable while holding the turn: {exc}"


@dataclass
class Keeping:
    """A request's hold on its turn, lease and arm pointer; ``lost`` says why it broke."""

    lost: str | None = None
    task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
