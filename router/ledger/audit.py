"""Auditing a replica's chain from its records alone (``kvledger audit chain``).

Every record satisfies ``state_after = H(state_before | digest)``, and within a generation seq
n+1 starts where seq n ended; a generation that began from a cache seen empty starts at
genesis. The replica's stream holds its records in chain order (step and record are written in
one Lua call), so one pass over it checks everything:

- ``break``: a record whose states do not follow (edited by hand, or a chain written by
  something else), or a generation that claims to start empty but not at genesis;
- ``gap``: a seq missing inside a generation (a record deleted);
- ``duplicate``: a request id twice;
- ``unknown``: records whose state descends from a cache nobody saw empty (counted, not an
  error: the records say so); ``unordered``: steps whose order was lost (they restart the chain
  at a fresh unknown state, and say so); ``stale``: requests of a generation that had ended.

A stream trimmed by its length cap begins mid-generation: that first gap is reported as
``trimmed``, not as an error.

The streams cannot show history that Redis lost (a restart without persistence, a FLUSHALL):
what remains is a whole chain again. The ledger epochs (``router.ledger.epoch``) can:
:func:`history` says which epochs the ledger saw and where its history starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from router.ledger.chain import genesis, step
from router.ledger.epoch import LOST_REASON, EpochInfo

ERRORS = ("break", "gap", "duplicate")
COUNTED = ("unknown", "unordered", "stale", "trimmed")


@dataclass
class ChainAudit:
    """What one replica's stream holds, and what is wrong with it."""

    replica: str
    records: int = 0
    generations: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERRORS + COUNTED, 0))
    findings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(self.counts[kind] == 0 for kind in ERRORS)

    def note(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        if kind in ERRORS and len(self.findings) < 100:
            self.findings.append(f"{self.replica}: {kind}: {message}")

    def as_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "records": self.records,
            "generations": self.generations,
            "ok": self.ok,
            **self.counts,
            "findings": self.findings,
        }


def audit_chain(replica: str, records: Iterable[dict[str, Any]]) -> ChainAudit:
    """Check a replica's records, in stream order (see the module docstring)."""
    auditor = Auditor(replica)
    for record in records:
        auditor.feed(record)
    return auditor.done()


class Auditor:
    """The audit of one stream, fed a record at a time (streams may not fit in memory)."""

    def __init__(self, replica: str) -> None:
        self.audit = ChainAudit(replica)
        self._seen: set[str] = set()
        self._last: dict[str, Any] | None = None  # the previous record of this generation
        self._generations: set[int] = set()

    def feed(self, record: dict[str, Any]) -> None:
        audit = self.audit
        audit.records += 1
        rid = str(record.get("request_id"))
        if rid in self._seen:
            audit.note("duplicate", f"request {rid} is recorded more than once")
            return
        self._seen.add(rid)
        if record.get("stale"):
            audit.note("stale", rid)
            return
        generation = int(record["generation"])
        if generation not in self._generations:
            self._generations.add(generation)
            self._last = None
        _check(audit, record, self._last, first_of_stream=audit.records == 1)
        self._last = record

    def done(self) -> ChainAudit:
        self.audit.generations = len(self._generations)
        return self.audit


def _check(
    audit: ChainAudit, record: dict[str, Any], last: dict[str, Any] | None, first_of_stream: bool
) -> None:
    rid, seq = record["request_id"], int(record["seq"])
    before, after = record["state_before"], record["state_after"]
    if record.get("state_known") is False:
        audit.note("unknown", rid)
    if record.get("unordered"):
        audit.note("unordered", rid)
    elif after != step(before, str(record["digest"])):
        audit.note("break", f"request {rid} (seq {seq}): state_after is not H(state_before|digest)")
    expected = 0 if last is None else int(last["seq"]) + 1
    if seq != expected:
        kind = "trimmed" if last is None and first_of_stream else "gap"
        audit.note(kind, f"seq {expected} to {seq - 1} missing before request {rid}")
    elif last is not None and before != last["state_after"]:
        audit.note("break", f"request {rid} (seq {seq}) does not start where seq {seq - 1} ended")
    if seq == 0 and record.get("state_known") and before != genesis(record["engine_digest"]):
        audit.note("break", f"request {rid} claims a cache seen empty but is not at genesis")


def history_start(epochs: list[EpochInfo]) -> tuple[EpochInfo, bool]:
    """Where the ledger's history starts (the last epoch created after a loss, else the first),
    and whether it is complete (no epoch lost). ``epochs`` is not empty."""
    lost = [e for e in epochs if e.previous]
    return (lost[-1], False) if lost else (epochs[0], True)


def history(epochs: list[EpochInfo]) -> list[str]:
    """Lines for ``audit chain``: every epoch seen, oldest first, and where history starts
    (pure: ``epochs`` as ``router.ledger.epoch.read_epochs`` answers them)."""
    if not epochs:
        return [
            "ledger epoch: none (a ledger written before epochs, or Redis lost its data and no"
            " proxy has run since): the audit cannot tell whether history was lost"
        ]
    lines = []
    for epoch in epochs:
        line = f"ledger epoch {epoch.id}: created {epoch.created_at}"
        if epoch.previous:
            seen = f", last seen {epoch.previous_seen_at}" if epoch.previous_seen_at else ""
            line += f", after epoch {epoch.previous} was lost ({LOST_REASON}{seen})"
        lines.append(line)
    start, complete = history_start(epochs)
    if not complete:
        lines.append(
            f"history starts at {start.created_at} (epoch {start.id}): {LOST_REASON} before it;"
            f" records of epoch {start.previous} are gone"
        )
    else:
        lines.append(f"history starts at {start.created_at} (epoch {epochs[-1].id}): complete")
    return lines


def history_json(epochs: list[EpochInfo]) -> dict[str, Any]:
    """``audit chain --json``'s last line: the epochs seen, oldest first, and where history
    starts (``history_starts`` null when the ledger has no epoch: it cannot tell)."""
    if not epochs:
        return {"ledger": {"epochs": [], "history_starts": None, "complete": None}}
    start, complete = history_start(epochs)
    ledger = {
        "epochs": [e.as_dict() for e in epochs],
        "current": epochs[-1].id,
        "history_starts": start.created_at,
        "complete": complete,
        "lost": [e.previous for e in epochs if e.previous],
    }
    return {"ledger": ledger}
