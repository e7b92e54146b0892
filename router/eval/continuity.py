"""Continuity: did exactly this one request touch the leased replica's cache?

Under its turn, a request reads the replica's request counter: it must equal the value stored
after the run's previous request (else another request touched the cache in between). After the
request, the counter must have moved by exactly one (a request completing alongside ours breaks
that too). Either way the request is served; its record says ``verified`` and, when not,
``warning``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from backends.base import BackendError
from router.fleet import ReplicaState
from router.ledger.turns import Turn


@dataclass(frozen=True, slots=True)
class Before:
    """The counter when the request was admitted, and why continuity is already broken."""

    count: int
    warning: str | None


def admitted(turn: Turn, run: str, replica: str, count: int) -> Before:
    """Compare the counter at admission with the one stored after the run's previous request."""
    if turn.run != run:
        return Before(count, f"continuity unknown: no request counter recorded for run {run}")
    if count != turn.count:
        return Before(count, warning(replica, run, count - turn.count))
    return Before(count, None)


async def counted(replica: ReplicaState, before: int, wait_s: float) -> int:
    """The counter once it shows this request (Triton counts a request a moment after its last
    response), or whatever it reads after ``wait_s``."""
    after = before
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(BackendError):
        while (after := await replica.backend.request_count()) <= before:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
    return after


async def settled(replica: ReplicaState, wait_s: float = 1.0) -> int:
    """The counter once it stops moving: a request that just finished is counted by Triton a
    moment after its last response, so an idle replica's first reading may still be short."""
    count = await replica.backend.request_count()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        again = await replica.backend.request_count()
        if again == count:
            return count
        count = again
    return count


def verdict(replica: str, run: str, before: Before, after: int) -> tuple[bool, str | None]:
    """``verified`` and the record's warning for a request that saw ``before`` and ``after``."""
    if before.warning is not None:
        return False, before.warning
    if after == before.count + 1:
        return True, None
    return False, warning(replica, run, after - before.count - 1)


def warning(replica: str, run: str, others: int) -> str:
    if others < 0:
        return f"continuity broken: replica {replica}'s request counter went back (reloaded?)"
    return (
        f"continuity broken: replica {replica} served {others} request(s) outside run {run}"
        " since the run's previous request"
    )
