"""Proof by replay (``kvledger runs explain A B``): is a divergence caused by cache state?

For the first divergent request of each episode (``runs diff``), and for each of the two runs:
lease a replica, reset it, replay everything its generation served before that request (the
run's own requests and whatever other eval runs served there, from their stored inputs) until
the fingerprint reaches the request's ``state_before``, then run the request and compare the
output with the run's. Once more on a replica with reuse off: the cold computation. A
divergence is *proven caused by cache state* when each run's output reproduces under its own
state. Histories are walked in chain order, so requests of one chain are proved in one pass
for as long as each reproduces.

A history cannot be replayed when it holds a request whose input was not kept (production
traffic) or starts from a state nobody saw empty; the case then says so and is not counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from router.errors import BadRequest, Unavailable
from router.eval.diff import diff_runs
from router.eval.replay import serve_one
from router.eval.reset import ResetFailed
from router.eval.runs import Runs
from router.ledger.chain import genesis
from router.ledger.keys import Profile

Record = dict[str, Any]
Progress = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Side:
    """One run's half of a case: its divergent request and whether it reproduced."""

    run: str
    record: Record = field(repr=False)
    reproduced: bool | None = None
    note: str = ""


@dataclass
class Case:
    episode: str
    position: int
    cause: str
    a: Side
    b: Side
    cold: str | None = None  # which run's output the cold computation matches: a, b, both, neither

    @property
    def proven(self) -> bool:
        return bool(self.a.reproduced and self.b.reproduced)

    def as_json(self) -> dict[str, Any]:
        side = {"record": None}
        return {
            "episode": self.episode,
            "position": self.position,
            "cause": self.cause,
            "proven": self.proven,
            "cold_matches": self.cold,
            "a": {**asdict(self.a), **side, "request_id": self.a.record["request_id"]},
            "b": {**asdict(self.b), **side, "request_id": self.b.record["request_id"]},
        }


class Explainer:
    """One explanation of two runs; ``progress`` hears about each step of the long work."""

    def __init__(self, runs: Runs, progress: Progress) -> None:
        self.runs, self.ledger, self.store = runs, runs.ledger, runs.store
        self.progress = progress
        self._inputs: dict[str, dict[str, Any]] = {}
        self._served = 0

    async def explain(
        self, run_a: str, run_b: str, *, episode: str | None, limit: int | None
    ) -> dict[str, Any]:
        cases = await self._cases(run_a, run_b, episode, limit)
        await self.progress({"event": "start", "cases": len(cases)})
        chains: defaultdict[tuple[str, int], list[Side]] = defaultdict(list)
        for case in cases:
            for side in (case.a, case.b):
                chains[(side.record["replica"], int(side.record["generation"]))].append(side)
        for (replica, generation), sides in chains.items():
            await self._prove_chain(replica, generation, sorted(sides, key=_seq))
        await self._cold(run_a, cases)
        tried = [c for c in cases if c.a.reproduced is not None and c.b.reproduced is not None]
        return {
            "run_a": run_a,
            "run_b": run_b,
            "tried": len(tried),
            "proven": sum(1 for c in tried if c.proven),
            "cases": [c.as_json() for c in cases],
        }

    async def _cases(
        self, run_a: str, run_b: str, episode: str | None, limit: int | None
    ) -> list[Case]:
        records = {run: await self.ledger.run_records(run) for run in (run_a, run_b)}
        by_id = {r["request_id"]: r for rs in records.values() for r in rs}
        diff = diff_runs(run_a, records[run_a], run_b, records[run_b])
        cases = [
            Case(
                e.episode,
                int(e.position or 0),
                str(e.cause),
                Side(run_a, by_id[str(e.request_a)]),
                Side(run_b, by_id[str(e.request_b)]),
            )
            for e in diff.episodes
            if e.kind == "output" and e.cause != "unknown"
            if episode is None or e.episode == episode
        ]
        if episode is not None and not cases:
            raise BadRequest(f"episode '{episode}' has no divergence to explain", param="episode")
        return cases[:limit] if limit is not None else cases

    async def _prove_chain(self, replica: str, generation: int, sides: list[Side]) -> None:
        """Replay the chain once, proving each side in order; begin again after a miss."""
        history = await self.ledger.generation_records(replica, generation, _seq(sides[-1]) + 1)
        problem = await self._replayable(history, _seq(sides[-1]))
        if problem is not None:
            for side in sides:
                side.note = problem
            return
        pending = list(sides)
        while pending:
            pending = await self._one_pass(history, pending)

    async def _one_pass(self, history: list[Record], sides: list[Side]) -> list[Side]:
        """Reset a leased replica, walk the history proving ``sides``; those left to prove."""
        model = str(history[0]["model"])
        profile = Profile(name=f"explain.{sides[0].run}", mode="eval", cache="reset")
        meta = await self.runs.begin(profile, model)
        try:
            if meta.get("engine_digest") != history[0]["engine_digest"]:
                for side in sides:
                    side.note = "the leased replica runs another engine than the run did"
                return []
            replica = self.runs.fleet[meta["replica"]]
            seq = 0
            for i, side in enumerate(sides):
                for record in history[seq : _seq(side)]:
                    await self._serve(meta, replica, record, "history")
                head = await self.ledger.head(replica.id)
                if head.state != side.record["state_before"]:
                    side.note = f"replay reached state {head.state[:12]}, not the run's"
                    return sides[i + 1 :]
                out = await self._serve(meta, replica, side.record, "divergent request")
                side.reproduced = out["output_digest"] == side.record["output_digest"]
                await self.progress({"event": "proved", "run": side.run, **_brief(side)})
                if not side.reproduced:
                    return sides[i + 1 :]  # the cache left the run's history: begin again
                seq = _seq(side) + 1
            return []
        finally:
            await self.runs.end(meta["id"], "explain done")

    async def _cold(self, run_a: str, cases: list[Case]) -> None:
        """Each case's request once more on a replica with reuse off."""
        if not cases:
            return
        profile = Profile(name=f"explain.{run_a}.cold", mode="eval", cache="off")
        try:
            meta = await self.runs.begin(profile, str(cases[0].a.record["model"]))
        except Unavailable as exc:
            await self.progress({"event": "cold_skipped", "reason": exc.message})
            return
        try:
            replica = self.runs.fleet[meta["replica"]]
            for case in cases:
                out = (await self._serve(meta, replica, case.a.record, "cold"))["output_digest"]
                a = out == case.a.record["output_digest"]
                b = out == case.b.record["output_digest"]
                case.cold = "both" if a and b else "a" if a else "b" if b else "neither"
                await self.progress(
                    {"event": "cold", "episode": case.episode, "matches": case.cold}
                )
        finally:
            await self.runs.end(meta["id"], "explain done")

    async def _serve(self, meta: dict[str, str], replica: Any, record: Record, why: str) -> Record:
        entry = self._inputs[record["request_id"]]
        self._served += 1
        rid = f"{meta['id']}.{self._served}"
        reason = f"explain: {why} {record['request_id']}"
        try:
            out = await serve_one(self.ledger, replica, meta["id"], meta["arm"], entry, rid, reason)
        except ResetFailed as exc:
            message = f"explain stopped: {exc.message}"
            raise Unavailable(message, headers={"Retry-After": "5"}) from exc
        await self.store.add_request(meta["id"], {"request_id": rid, **entry})
        return out

    async def _replayable(self, history: list[Record], upto: int) -> str | None:
        """Why the history up to ``upto`` cannot be rebuilt, or None (inputs then loaded)."""
        if [r["seq"] for r in history] != list(range(upto + 1)):
            return "the replica's lineage has gaps before the request (trimmed or lost)"
        first = history[0]
        if not first.get("state_known", True) or first["state_before"] != genesis(
            first["engine_digest"]
        ):
            return "its generation began from a state nobody saw empty"
        for record in history:
            entry = await self._input(record)
            if entry is None:
                return f"request {record['request_id']} has no stored input (not an eval run's)"
        return None

    async def _input(self, record: Record) -> dict[str, Any] | None:
        rid, run = str(record["request_id"]), record.get("run")
        if rid not in self._inputs and run:
            for entry in await self.store.requests(run):
                self._inputs.setdefault(entry["request_id"], _entry(entry))
            meta = await self.store.get(run) or {}
            cache = meta.get("cache", "")
            if cache.startswith("replay:") and rid.startswith(f"{run}.replay."):
                snapshot = await self.store.snapshot(cache.removeprefix("replay:")) or {}
                requests = snapshot.get("requests", [])
                for i, entry in enumerate(requests, 1):
                    self._inputs.setdefault(f"{run}.replay.{i}", _entry(entry))
        return self._inputs.get(rid)


def _entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {"model": entry["model"], "prompt": entry["prompt"], "params": entry["params"]}


def _seq(side: Side) -> int:
    return int(side.record["seq"])


def _brief(side: Side) -> dict[str, Any]:
    return {"request_id": side.record["request_id"], "reproduced": side.reproduced}
