"""Compare two eval runs request by request, and classify each first divergence falsifiably.

Alignment: when every record of both runs carries a non-empty ``episode``, requests are grouped
by episode and compared position by position inside each episode, so the runs may interleave
their episodes differently. Otherwise each run is treated as one sequence labelled ``-``.

Per episode the first differing position is reported. If the clients sent the same prompt and
params and got different outputs, the two records say why, by a rule that can come out either
way (in a rerun on a warm cache the states differ by construction, so "the states differ" alone
would explain everything and prove nothing):

- ``unknown``: either request's cache state is unknown (a replica first seen warm, a chain that
  lost its order, a stale step): the ledger cannot say;
- ``reuse``: the engine reused a different number of KV blocks (or cached tokens) for the two
  requests: the computation itself differed, the reuse path's numerics are the suspect;
- ``state``: equal reuse, different cache states: the reused blocks held different contents;
- ``unexplained``: same input, same state, same reuse, different output: not the cache.

``kvledger runs explain`` turns a ``reuse`` or ``state`` classification into a proof by replay.
Later positions are not compared: after one difference the conversations may legitimately fork.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

Record = Mapping[str, Any]

ORDER_LABEL = "-"


@dataclass(frozen=True, slots=True)
class EpisodeDiff:
    """How one episode compares across the two runs; ``position`` is None when identical."""

    episode: str
    requests_a: int
    requests_b: int
    position: int | None
    kind: str
    cause: str | None  # reuse, state, unexplained or unknown; None unless kind is "output"
    request_a: str | None
    request_b: str | None
    state_a: str | None
    state_b: str | None
    reused_a: int | None = None
    reused_b: int | None = None


CAUSES = ("reuse", "state", "unexplained", "unknown")


@dataclass(frozen=True, slots=True)
class RunDiff:
    run_a: str
    run_b: str
    aligned_by: str
    episodes: tuple[EpisodeDiff, ...]

    @property
    def identical(self) -> int:
        return sum(1 for e in self.episodes if e.kind == "identical")

    @property
    def diverged(self) -> int:
        return len(self.episodes) - self.identical

    @property
    def other(self) -> int:
        return sum(1 for e in self.episodes if e.kind not in ("identical", "output"))

    def caused(self, cause: str) -> int:
        return sum(1 for e in self.episodes if e.kind == "output" and e.cause == cause)

    def counts(self) -> dict[str, int]:
        return {
            "episodes": len(self.episodes),
            "identical": self.identical,
            "diverged": self.diverged,
            **{cause: self.caused(cause) for cause in CAUSES},
            "other": self.other,
        }

    def summary(self) -> str:
        return (
            f"{len(self.episodes)} episodes: {self.identical} identical, {self.diverged} diverged"
            f" ({self.caused('reuse')} reuse differed, {self.caused('state')} state differed with"
            f" equal reuse, {self.caused('unexplained')} unexplained,"
            f" {self.caused('unknown')} from an unknown state, {self.other} other)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "aligned_by": self.aligned_by,
            "summary": self.counts(),
            "episodes": [asdict(e) for e in self.episodes],
        }


def diff_runs(
    run_a: str, records_a: Sequence[Record], run_b: str, records_b: Sequence[Record]
) -> RunDiff:
    """Align the runs (by episode when all records have one, else by order) and diff each pair.
    Records that are not the run's own answers are left out: a failover's replay (policy
    ``replay``) and a request that failed with its replica and was retried after the move."""
    records_a, records_b = _own(records_a), _own(records_b)
    by_episode = all(r.get("episode") for r in (*records_a, *records_b))
    if by_episode:
        groups_a, groups_b = _group(records_a), _group(records_b)
    else:
        groups_a, groups_b = {ORDER_LABEL: list(records_a)}, {ORDER_LABEL: list(records_b)}
    names = list(groups_a) + [name for name in groups_b if name not in groups_a]
    episodes = tuple(_diff_episode(n, groups_a.get(n), groups_b.get(n)) for n in names)
    return RunDiff(run_a, run_b, "episode" if by_episode else "order", episodes)


def _own(records: Sequence[Record]) -> list[Record]:
    return [
        r
        for r in records
        if not r.get("failover")
        and not (r.get("policy") == "replay" and "failover of run" in str(r.get("reason")))
    ]


def _group(records: Sequence[Record]) -> dict[str, list[Record]]:
    # dicts keep insertion order, which is the order of first appearance the result promises.
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(str(record["episode"]), []).append(record)
    return groups


def _diff_episode(name: str, a: list[Record] | None, b: list[Record] | None) -> EpisodeDiff:
    if a is None or b is None:
        # A missing episode reads like a length difference from position 0 on.
        return _at(name, a or [], b or [], 0, "missing")
    for position, (ra, rb) in enumerate(zip(a, b, strict=False)):
        kind = _compare(ra, rb)
        if kind is not None:
            return _at(name, a, b, position, kind)
    if len(a) != len(b):
        return _at(name, a, b, min(len(a), len(b)), "length")
    return EpisodeDiff(name, len(a), len(b), None, "identical", None, None, None, None, None)


def cause(a: Record, b: Record) -> str:
    """Why two requests with the same input gave different outputs (see the module docstring)."""
    for r in (a, b):
        known = r.get("state_known", True) is not False
        if r.get("state_before") is None or not known or r.get("stale") or r.get("unordered"):
            return "unknown"
    if (a.get("reused_blocks"), a.get("cached_tokens")) != (
        b.get("reused_blocks"),
        b.get("cached_tokens"),
    ):
        return "reuse"
    if a.get("state_before") != b.get("state_before"):
        return "state"
    return "unexplained"


def _compare(a: Record, b: Record) -> str | None:
    """The kind of difference between two aligned requests, None when they count as the same."""
    # Different inputs come first: whatever else differs, the clients asked different things.
    if a.get("prompt_digest") != b.get("prompt_digest"):
        return "input"
    if a.get("params_digest") != b.get("params_digest"):
        return "input"
    if a.get("status") != b.get("status"):
        return "status"
    # Two failures of the same kind carry no comparable output (partial text, error bodies).
    if a.get("status") != "ok":
        return None
    if a.get("output_digest") != b.get("output_digest"):
        return "output"
    return None


def _at(name: str, a: list[Record], b: list[Record], position: int, kind: str) -> EpisodeDiff:
    ra = a[position] if position < len(a) else None
    rb = b[position] if position < len(b) else None
    why = cause(ra, rb) if kind == "output" and ra is not None and rb is not None else None
    return EpisodeDiff(
        episode=name,
        requests_a=len(a),
        requests_b=len(b),
        position=position,
        kind=kind,
        cause=why,
        request_a=_field(ra, "request_id"),
        request_b=_field(rb, "request_id"),
        state_a=_field(ra, "state_before"),
        state_b=_field(rb, "state_before"),
        reused_a=None if ra is None else ra.get("reused_blocks"),
        reused_b=None if rb is None else rb.get("reused_blocks"),
    )


def _field(record: Record | None, key: str) -> str | None:
    value = None if record is None else record.get(key)
    return None if value is None else str(value)


COLUMNS = (
    "episode",
    "requests",
    "first diff",
    "kind",
    "cause",
    "reused A/B",
    "state A",
    "state B",
)
CAUSE_LABELS = {
    "reuse": "reuse differed",
    "state": "state differed",
    "unexplained": "UNEXPLAINED",
    "unknown": "unknown state",
}


def render_table(diff: RunDiff, *, all_episodes: bool = False) -> list[str]:
    """Header, one row per diverged episode (every episode with ``all_episodes``), summary."""
    header = f"run A: {diff.run_a}   run B: {diff.run_b}   aligned by {diff.aligned_by}"
    shown = [e for e in diff.episodes if all_episodes or e.kind != "identical"]
    if not shown:
        return [header, diff.summary()]
    rows = [list(COLUMNS)] + [_row(e) for e in shown]
    sizes = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    table = [
        "  ".join(v.ljust(n) for v, n in zip(row, sizes, strict=True)).rstrip() for row in rows
    ]
    return [header, *table, diff.summary()]


def _row(e: EpisodeDiff) -> list[str]:
    return [
        e.episode,
        f"{e.requests_a}/{e.requests_b}",
        "-" if e.position is None else str(e.position),
        e.kind,
        "-" if e.cause is None else CAUSE_LABELS[e.cause],
        "-" if e.kind != "output" else f"{e.reused_a}/{e.reused_b}",
        "-" if e.state_a is None else e.state_a[:12],
        "-" if e.state_b is None else e.state_b[:12],
    ]
