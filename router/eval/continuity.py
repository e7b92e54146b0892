"""Continuity: did exactly this one request touch the leased replica's cache?

Under its turn, a request reads the replica's request counter: it must equal the value stored
after the run's previous request (else another request touched the cache in between). After the
request, the counter must have moved by exactly one (a request completing alongside ours breaks
that too). Either way the request is served; its record says ``verified`` and, when not,
``warning``.

What the counter counts differs by backend (TensorRT-LLM's ``model_instance_state.cc``,
``reportBaseMetrics``; python_backend's ``python_be.cc``): the C++ backend counts a request once,
at its final response, and answers a ``stop`` request without counting it; the Python backend
counts every ``execute``, stop requests included. A request the proxy abandoned is followed by
one stop request (``backends.triton``: ``stops_sent``), so it moves the counter by one (C++) or
two (Python); either is this request alone. The abandoned request itself is counted only when
its final response leaves the engine, a moment after the stop took effect: the counter is read
once it shows the request and the stops, or once it has held still after showing the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from backends.base import BackendError
from router.fleet import ReplicaState
from router.ledger.turns import Turn

_STILL_S = 0.25  # a counter that showed the request and held still this long is settled


@dataclass(frozen=True, slots=True)
class Before:
    """The counter when the request was admitted, and why continuity is already broken."""

    count: int
    warning: str | None
    stops: int = 0  # stop requests the replica's client had sent by then (``stops_sent``)


def stops_sent(replica: ReplicaState) -> int:
    """Stop requests the replica's engine client has sent (0 for a client that sends none)."""
    return int(getattr(replica.backend, "stops_sent", 0))


def admitted(turn: Turn, run: str, replica: str, count: int, stops: int = 0) -> Before:
    """Compare the counter at admission with the one stored after the run's previous request."""
    if turn.run != run:
        return Before(
            count, f"continuity unknown: no request counter recorded for run {run}", stops
        )
    if count != turn.count:
        return Before(count, warning(replica, run, count - turn.count), stops)
    return Before(count, None, stops)


async def counted(replica: ReplicaState, before: int | Before, wait_s: float) -> int:
    """The counter once it shows this request (Triton counts a request a moment after its last
    response) and the stop requests sent for it, or once it showed the request and then held
    still (a backend that does not count stops), or whatever it reads after ``wait_s``."""
    start = before.count if isinstance(before, Before) else before
    stops = stops_sent(replica) - before.stops if isinstance(before, Before) else 0
    after, seen_at = start, 0.0
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(BackendError):
        while True:
            now, previous = time.monotonic(), after
            after = await replica.backend.request_count()
            if after >= start + 1 + stops or now > deadline:
                break
            if after > start:
                seen_at = now if after != previous or not seen_at else seen_at
                if now - seen_at >= _STILL_S:
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


def verdict(
    replica: str, run: str, before: Before, after: int, stops: int = 0
) -> tuple[bool, str | None]:
    """``verified`` and the record's warning for a request that saw ``before`` and ``after``,
    for which the proxy sent ``stops`` stop requests (counted or not, by backend)."""
    if before.warning is not None:
        return False, before.warning
    others = after - before.count - 1
    if 0 <= others <= stops:
        return True, None
    return False, warning(replica, run, others if others < 0 else others - stops)


def warning(replica: str, run: str, others: int) -> str:
    if others < 0:
        return f"continuity broken: replica {replica}'s request counter went back (reloaded?)"
    return (
        f"continuity broken: replica {replica} served {others} request(s) outside run {run}"
        " since the run's previous request"
    )
