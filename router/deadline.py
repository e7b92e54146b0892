"""A no-progress deadline for a stream, cheap enough to check on every chunk.

``asyncio.timeout`` around each ``anext`` costs a timer per chunk (about 5 µs under uvloop,
so a streamed request of a few hundred tokens would pay more than the whole proxy budget). A
:class:`Deadline` keeps one timer per stream instead and re-arms it only when it fires: per
chunk it records when the wait began. When the timer finds the current wait older than the
deadline, it cancels the waiting task the way ``asyncio.timeout`` does, and :meth:`expired`
tells that cancellation apart from any other (a client gone, a shutdown).

A wait may also be credited with progress that is not a chunk (``credit``): a request waiting
for its first chunk (a prefill, or a whole non-streamed answer, which Triton sends at once) shows
nothing of its own until it arrives, so the engine's own progress counts instead (see
``router.fleet``). The deadline is then ``timeout_s`` after the later of the wait's start and the
credit's ``progressed_at``.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Credit(Protocol):
    """Progress seen elsewhere: when it was last seen, on the event loop's clock."""

    progressed_at: float


class Deadline:
    def __init__(self, timeout_s: float, credit: Credit | None = None) -> None:
        self.timeout_s = timeout_s
        self.credit = credit  # None: only the waits' own ends count as progress
        self.loop = asyncio.get_running_loop()  # (a system call each time in 3.11: getpid)
        self._since: float | None = None  # when the current wait began; None between waits
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False

    def waiting(self) -> None:
        """A wait for the next chunk begins in the current task (the one that began the first
        wait: a stream is read by one task)."""
        self._since = self.loop.time()
        if self._task is None:
            self._task = asyncio.current_task(self.loop)  # the loop given: no getpid()
        if self._task is not None:
            self._cancelling = self._task.cancelling()
        if self._handle is None:
            self._handle = self.loop.call_at(self._since + self.timeout_s, self._fire)

    def done(self) -> None:
        """The wait ended (a chunk, the end, an error)."""
        self._since = None

    def expired(self) -> bool:
        """Call on CancelledError: True when the deadline caused it, and only the deadline
        (the task's cancellation is then withdrawn); False when it must propagate."""
        if not self._fired or self._task is None:
            return False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if self._since is None:
            return  # not waiting: the next wait arms the timer again
        due = self._since + self.timeout_s
        credit = self.credit
        if credit is not None and credit.progressed_at + self.timeout_s > due:
            due = credit.progressed_at + self.timeout_s
        # The loop may run a timer up to its clock resolution early: a millisecond is close enough.
        if self.loop.time() >= due - 1e-3 and self._task is not None:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self.loop.call_at(due, self._fire)
