"""One request at a time: waiting for a turn on a leased replica, keeping it, giving it back.

A request of a run takes a ticket in the replica's queue (``router.ledger.turns``) and waits
until its ticket is at the head and nobody holds the turn, in arrival order across proxy
instances. While it runs, a keeper task renews the turn (its fence token's expiry); when it
ends, the turn is released and this proxy's waiters on that replica are woken at once (other
proxies' waiters poll).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict

from router.errors import Unavailable
from router.ledger import LedgerError
from router.ledger.turns import Turn, TurnLost, Turns
from router.settings import EvalSettings

WAITER_TTL_MS = 10_000  # a waiting request refreshes its ticket far more often than this


class TurnKeeper:
    """Queueing and the turn's lifetime; one per proxy instance."""

    def __init__(self, turns: Turns, settings: EvalSettings) -> None:
        self.turns = turns
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released[replica].wait(), delay)
                delay = min(delay * 2, 0.05)
        except BaseException:
            with contextlib.suppress(LedgerError):
                await asyncio.shield(self.turns.release(replica, ticket))
            raise

    def keep(self, turn: Turn) -> asyncio.Task[None]:
        """Renew the turn while the request runs; cancel the task when it ends."""
        return asyncio.create_task(self._renew(turn), name=f"kvl-turn-{turn.replica}")

    async def release(self, turn: Turn) -> None:
        """Give the turn back and wake this proxy's waiters; never raises for Redis."""
        with contextlib.suppress(LedgerError):
            await self.turns.release(turn.replica, turn.ticket, turn.token)
        event = self._released.pop(turn.replica, None)
        if event is not None:
            event.set()

    async def _renew(self, turn: Turn) -> None:
        ttl_ms = int(self.settings.turn_ttl_s * 1000)
        with contextlib.suppress(LedgerError):
            while True:
                await asyncio.sleep(self.settings.turn_ttl_s / 3)
                await self.turns.renew_turn(turn, ttl_ms)
