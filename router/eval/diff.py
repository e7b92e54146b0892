"""Compare two eval runs request by request and say whether cache state explains a divergence.

Alignment: when every record of both runs carries a non-empty ``episode``, requests are grouped
by episode and compared position by position inside each episode, so the runs may interleave
their episodes differently. Otherwise each run is treated as one sequence labelled ``-``.

Per episode the first differing position is reported. If the clients sent the same prompt and
params and got different outputs, the cache states the two requests were admitted on decide:
different states explain the divergence (prefix reuse changed the numerics); equal states leave
it UNEXPLAINED (same input, same cache, different output); an unknown state leaves it unknown.
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
    explained: bool | None
    request_a: str | None
    request_b: str | None
    state_a: str | None
    state_b: str | None


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
    def explained(self) -> int:
        return self._outputs(True)

    @property
    def unexplained(self) -> int:
        return self._outputs(False)

    @property
    def unknown(self) -> int:
        return self._outputs(None)

    @property
    def other(self) -> int:
        return sum(1 for e in self.episodes if e.kind not in ("identical", "output"))

    def _outputs(self, explained: bool | None) -> int:
        return sum(1 for e in self.episodes if e.kind == "output" and e.explained is explained)

    def counts(self) -> dict[str, int]:
        return {
            "episodes": len(self.episodes),
            "identical": self.identical,
            "diverged": self.diverged,
            "explained": self.explained,
            "unexplained": self.unexplained,
            "unknown": self.unknown,
            "other": self.other,
        }

    def summary(self) -> str:
        return (
            f"{len(self.episodes)} episodes: {self.identical} identical, {self.diverged} diverged"
            f" ({self.explained} explained by cache state, {self.unexplained} unexplained,"
            f" {self.unknown} unknown, {self.other} other)"
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
    """Align the runs (by episode when all records have one, else by order) and diff each pair."""
    by_episode = all(r.get("episode") for r in (*records_a, *records_b))
    if by_episode:
        groups_a, groups_b = _group(records_a), _group(records_b)
    else:
        groups_a, groups_b = {ORDER_LABEL: list(records_a)}, {ORDER_LABEL: list(records_b)}
    names = list(groups_a) + [name for name in groups_b if name not in groups_a]
    episodes = tuple(_diff_episode(n, groups_a.get(n), groups_b.get(n)) for n in names)
    return RunDiff(run_a, run_b, "episode" if by_episode else "order", episodes)


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
    state_a = _field(ra, "state_before")
    state_b = _field(rb, "state_before")
    explained = None
    if kind == "output" and state_a is not None and state_b is not None:
        explained = state_a != state_b
    return EpisodeDiff(
        episode=name,
        requests_a=len(a),
        requests_b=len(b),
        position=position,
        kind=kind,
        explained=explained,
        request_a=_field(ra, "request_id"),
        request_b=_field(rb, "request_id"),
        state_a=state_a,
        state_b=state_b,
    )


def _field(record: Record | None, key: str) -> str | None:
    value = None if record is None else record.get(key)
    return None if value is None else str(value)


COLUMNS = ("episode", "requests", "first diff", "kind", "cause", "state A", "state B")


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
        _cause(e),
        "-" if e.state_a is None else e.state_a[:12],
        "-" if e.state_b is None else e.state_b[:12],
    ]


def _cause(e: EpisodeDiff) -> str:
    if e.kind != "output":
        return "-"
    if e.explained is None:
        return "unknown"
    return "cache state" if e.explained else "UNEXPLAINED"
