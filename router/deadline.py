"""A no-progress deadline for a stream, cheap enough to check on every chunk.

``asyncio.timeout`` around each ``anext`` costs a timer per chunk (about 5 µs under uvloop,
so a streamed request of a few hundred tokens would pay more than the whole proxy budget). A
:class:`Deadline` keeps one timer per stream instead and re-arms it only when it fires: per
chunk it records when the wait began. When the timer finds the current wait older than the
deadline, it cancels the waiting task the way ``asyncio.timeout`` does, and :meth:`expired`
tells that cancellation apart from any other (a client gone, a shutdown).
"""

from __future__ import annotations

import asyncio


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the current wait began; None between waits
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False

    def waiting(self) -> None:
        """A wait for the next chunk begins in the current task (the one that began the first
        wait: a stream is read by one task)."""
        self._since = self._loop.time()
        if self._task is None:
            self._task = asyncio.current_task(self._loop)  # the loop given: no getpid()
        if self._task is not None:
            self._cancelling = self._task.cancelling()
        if self._handle is None:
            self._handle = self._loop.call_at(self._since + self.timeout_s, self._fire)

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
        # The loop may run a timer up to its clock resolution early: a millisecond is close enough.
        if self._loop.time() >= due - 1e-3 and self._task is not None:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(due, self._fire)
