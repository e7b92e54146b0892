"""The local spool: lineage jobs that could not (yet) be written to Redis, in submit order.

Format: one JSON object per line, ``{"step": STEP, "record": RECORD}\\n``, appended with
``O_APPEND``; ``STEP`` is null for a finished record (only its indexes are due), or
``{"replica", "generation", "digest", "exact", "tried_ms", "epoch"}`` for a record whose chain
step has not run yet (its RECORD then lacks the chain fields; ``tried_ms`` is when a call that
may have run it was sent, or null; ``epoch`` the ledger epoch it was made in, or null). Next to
it, ``<spool>.done`` holds the byte offset up to which the lines are in Redis (replaced
atomically by rename). Draining reads from that offset; when everything is drained the file is
truncated, after a durable marker of 0, so a crash at any point loses nothing: at worst a batch
is written again (readers drop repeated request ids, and late chain steps are idempotent through
their step keys). A torn last line (a crash mid-append) is cut off when the spool is opened; an
``flock`` keeps two processes off one spool.

``<spool>.tried`` lists the request ids (with the time, epoch ms) whose late step the writer
sent to Redis, written and fsynced *before* the send: a spool line is never rewritten, so a
step whose reply was lost would otherwise be read back as never tried, and retried after its
step key expired it could run as a second certain step. It is emptied with the spool.

Writes are a single ``write`` of a few hundred lines at most, on the event loop: that costs
microseconds (the page cache takes them) and keeps every append in order without a lock.
``fsync`` (milliseconds or worse) and reading back for a drain run in a thread.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import structlog

_READ_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Step:
    """A chain step still to run: the record's request moved ``replica`` by ``digest``."""

    replica: str
    generation: int
    digest: str
    exact: bool = False
    tried_ms: int | None = None  # a call that may have run it was sent then (epoch ms)
    epoch: str | None = None  # the ledger epoch its record was made in (see ``epoch``)


@dataclass(slots=True, eq=False)
class Job:
    """One lineage record on its way to Redis, with its chain step when that is still due."""

    request_id: str
    run: str | None
    data: bytes
    step: Step | None = None
    spool_end: int | None = None  # where its spool line ends, once spooled

    def line(self) -> bytes:
        # The record's bytes are spliced in as they are: spooling never re-encodes it.
        step = None if self.step is None else _step_json(self.step)
        return b'{"step":' + orjson.dumps(step) + b',"record":' + self.data + b"}\n"


def _step_json(step: Step) -> dict[str, Any]:
    return {
        "replica": step.replica,
        "generation": step.generation,
        "digest": step.digest,
        "exact": step.exact,
        "tried_ms": step.tried_ms,
        "epoch": step.epoch,
    }


def job_from_record(record: dict[str, Any], data: bytes, step: Step | None) -> Job:
    run = record.get("run")
    return Job(str(record.get("request_id")), None if run is None else str(run), data, step)


def job_from_line(line: bytes) -> Job:
    """The job a spool line holds; raises ValueError (or KeyError, TypeError) on a bad line."""
    obj = orjson.loads(line)
    record = obj["record"]
    raw = obj["step"]
    step = None
    if raw is not None:
        tried = raw.get("tried_ms")
        step = Step(
            raw["replica"],
            int(raw["generation"]),
            raw["digest"],
            bool(raw.get("exact", False)),
            None if tried is None else int(tried),
            raw.get("epoch"),
        )
    return job_from_record(record, orjson.dumps(record), step)


class SpoolBusy(OSError):
    """Another process holds the spool file."""


class Spool:
    def __init__(self, path: Path, log: structlog.typing.FilteringBoundLogger) -> None:
        self.path = path
        self.marker = path.with_name(path.name + ".done")
        self.tried_path = path.with_name(path.name + ".tried")
        self.tried: dict[str, int] = {}  # request id -> when its step was first sent (ms)
        self._log = log
        self._fd: int | None = None
        self._torn = False  # a failed write may have left half a line at the end
        self.size = 0  # bytes in the file
        self.done = 0  # bytes already in Redis
        self.count = 0  # lines between done and size

    @property
    def pending(self) -> bool:
        return self.done < self.size

    def open(self) -> None:
        """Open (creating) and lock the spool; find what a previous process left. Blocking."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise SpoolBusy(f"spool {self.path} is locked by another process") from exc
        self._fd = fd
        self.size = os.fstat(fd).st_size
        self.done = min(self._read_marker(), self.size)
        self._cut_torn_tail()
        self.count = self._count_lines(self.done, self.size)
        self.tried = self._read_tried() if self.pending else {}

    def mark_tried(self, request_ids: Sequence[str], at_ms: int) -> None:
        """Note (durably: blocking, run it in a thread) that these steps are about to be sent."""
        fresh = [rid for rid in request_ids if rid not in self.tried]
        if fresh:
            lines = "".join(f"{rid} {at_ms}\n" for rid in fresh).encode()
            fd = os.open(self.tried_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, lines)
                os.fsync(fd)
            finally:
                os.close(fd)
        for rid in fresh:
            self.tried[rid] = at_ms

    def with_tried(self, job: Job) -> Job:
        """``job`` with the time its step was first sent, when the tried list has it."""
        step = job.step
        if step is not None and step.tried_ms is None and job.request_id in self.tried:
            job.step = replace(step, tried_ms=self.tried[job.request_id])
        return job

    def _read_tried(self) -> dict[str, int]:
        tried: dict[str, int] = {}
        try:
            text = self.tried_path.read_text()
        except OSError:
            return tried
        for line in text.splitlines():
            rid, _, at = line.rpartition(" ")
            if rid and at.isdigit():
                tried.setdefault(rid, int(at))
        return tried

    def _forget_tried(self) -> None:
        self.tried = {}
        try:
            os.truncate(self.tried_path, 0)
        except FileNotFoundError:
            pass
        except OSError as exc:
            path = str(self.tried_path)
            self._log.error("ledger_tried_truncate_failed", path=path, error=str(exc))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also releases the flock
            self._fd = None

    def append(self, jobs: Sequence[Job]) -> bool:
        """Write ``jobs`` in order, all or none; False when the disk refused them."""
        if self._fd is None:
            return False
        lines = [job.line() for job in jobs]
        prefix = b"\n" if self._torn else b""
        data = prefix + b"".join(lines)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._rewind(exc)
            return False
        end = self.size + len(prefix)
        for job, line in zip(jobs, lines, strict=True):
            end += len(line)
            job.spool_end = end
        self.size += len(data)
        self.count += len(jobs)
        self._torn = False
        return True

    def fsync(self) -> None:
        """Blocking: run it in a thread."""
        if self._fd is not None:
            os.fsync(self._fd)

    def read(self, start: int, end: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` whole lines in ``[start, end)``, each with its end offset. Blocking."""
        if self._fd is None:
            return []
        size = min(end - start, _READ_CHUNK)
        chunk = os.pread(self._fd, size, start)
        while b"\n" not in chunk and size < end - start:  # one line longer than a chunk
            size = min(end - start, size * 4)
            chunk = os.pread(self._fd, size, start)
        lines: list[tuple[int, bytes]] = []
        at = 0
        while len(lines) < limit and (newline := chunk.find(b"\n", at)) >= 0:
            lines.append((start + newline + 1, chunk[at : newline + 1]))
            at = newline + 1
        return lines

    def mark_done(self, offset: int, lines: int) -> None:
        """Lines up to ``offset`` are in Redis. The marker is not fsynced: if a machine crash
        loses it, an older one makes those lines go to Redis again, which readers tolerate."""
        self.done = offset
        self.count -= lines
        self.save_marker(offset)

    def save_marker(self, offset: int, durable: bool = False) -> None:
        """Durable means fsynced, file and directory: blocking, run it in a thread."""
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        try:
            with tmp.open("w") as f:
                f.write(str(offset))
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.marker)
            if durable:
                directory = os.open(self.marker.parent, os.O_RDONLY)
                try:
                    os.fsync(directory)
                finally:
                    os.close(directory)
        except OSError as exc:
            self._log.error("ledger_spool_marker_failed", path=str(self.marker), error=str(exc))

    def truncate(self, end: int) -> bool:
        """Empty the spool if it still ends at ``end`` and all of it is in Redis.

        Call it only after a durable marker of 0: a crash before or after the truncation then
        sends lines again, and no stale marker can ever skip lines appended after it.
        """
        if self._fd is None or self.size != end or self.done != end:
            return False
        try:
            os.ftruncate(self._fd, 0)
        except OSError as exc:
            self._log.error("ledger_spool_truncate_failed", path=str(self.path), error=str(exc))
            return False
        self.size = self.done = self.count = 0
        self._forget_tried()
        return True

    def _rewind(self, exc: OSError) -> None:
        self._log.error("ledger_spool_write_failed", path=str(self.path), error=str(exc))
        try:
            if self._fd is not None:
                os.ftruncate(self._fd, self.size)
        except OSError:
            self._torn = True

    def _read_marker(self) -> int:
        try:
            return int(self.marker.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _cut_torn_tail(self) -> None:
        if self._fd is None or self.size <= self.done:
            return
        length = min(self.size - self.done, _READ_CHUNK)
        tail = os.pread(self._fd, length, self.size - length)
        if tail.endswith(b"\n"):
            return
        # rfind is -1 without a newline: then the whole undrained part is one torn line.
        keep = self.size - length + tail.rfind(b"\n") + 1 if b"\n" in tail else self.done
        self._log.warning("ledger_spool_torn_tail", path=str(self.path), cut_bytes=self.size - keep)
        os.ftruncate(self._fd, keep)
        self.size = keep

    def _count_lines(self, start: int, end: int) -> int:
        count = 0
        while self._fd is not None and start < end:
            chunk = os.pread(self._fd, min(_READ_CHUNK, end - start), start)
            if not chunk:
                break
            count += chunk.count(b"\n")
            start += len(chunk)
        return count
