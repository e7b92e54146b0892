"""A heartbeat: renew a claim in Redis while work goes on, and notice when the claim is lost.

Resets, run begins and eval requests hold claims with short expiries (a reset's mark, a begin's
owner key, a request's turn and its run's lease), so that a proxy that dies lets go of them
within seconds. While the holder lives, a heartbeat renews them; a renewal that finds the claim
gone (or Redis unreachable) is remembered as ``lost``, for the holder to act on: the work's
result can no longer be trusted to be exclusive.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from router.ledger import LedgerError

Renew = Callable[[], Awaitable[str | None]]  # None while the claim holds, else why it is lost


class Heartbeat:
    """The running heartbeat; ``lost`` says why the claim was lost (None while it holds)."""

    def __init__(self) -> None:
        self.lost: str | None = None


@contextlib.asynccontextmanager
async def heartbeat(renew: Renew, every_s: float) -> AsyncIterator[Heartbeat]:
    """Call ``renew`` every ``every_s`` seconds inside the block; stop at the first loss."""
    beat = Heartbeat()

    async def loop() -> None:
        while beat.lost is None:
            await asyncio.sleep(every_s)
            try:
                beat.lost = await renew()
            except LedgerError as exc:
                beat.lost = f"Redis unreachable while renewing: {exc}"

    task = asyncio.create_task(loop(), name="kvl-heartbeat")
    try:
        yield beat
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
