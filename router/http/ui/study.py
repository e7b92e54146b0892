"""The Arms table (the study, live) and the Fleet (replicas and their generations).

Arms: per arm, every later run compared with the arm's first run by ``diff_runs`` (as
``bench/eval_study.py`` does for its report), with block reuse, wall time per run, the causes,
and the proofs of the explanations this proxy ran; a bar chart of divergence per arm drawn
here as SVG (no script, no CDN). Fleet: what this proxy knows of each replica (pool, lease,
health) with its chain head from Redis, and a timeline of ``kvl:generations``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from router.eval.diff import CAUSES, diff_runs
from router.http.admin import redis_errors
from router.http.context import FLEET, LEDGER, RUNS
from router.http.ui.auth import page, render
from router.http.ui.compare import JOBS
from router.ledger.export import at_ms

RUN_SCAN = 200
CHART_W, BAR_H, LABEL_W = 640, 22, 160


@dataclass
class Arm:
    name: str
    cache: str
    first: str
    runs: int = 0
    compared: int = 0
    episodes: int = 0  # episodes compared, over every later run
    diverged: int = 0
    causes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    reused: int = 0
    blocks: int = 0
    walls: list[float] = field(default_factory=list)
    tried: int = 0
    proven: int = 0

    @property
    def pct(self) -> float:
        return 100.0 * self.diverged / self.episodes if self.episodes else 0.0

    @property
    def reuse_pct(self) -> float | None:
        return 100.0 * self.reused / self.blocks if self.blocks else None

    @property
    def wall_s(self) -> float | None:
        return statistics.mean(self.walls) if self.walls else None


def _wall(meta: dict[str, str]) -> float | None:
    began, ended = at_ms(meta.get("began_at")), at_ms(meta.get("ended_at"))
    return None if began is None or ended is None else (ended - began) / 1000


async def _arms(request: web.Request) -> list[Arm]:
    ledger = request.app[LEDGER]
    metas = list(reversed(await request.app[RUNS].store.recent(RUN_SCAN)))  # oldest first
    arms: dict[str, Arm] = {}
    firsts: dict[str, list[dict[str, Any]]] = {}
    for meta in metas:
        name = meta.get("arm", "")
        if not name or name.startswith("explain."):
            continue  # explain's own runs are replays, not the study's
        records = await ledger.run_records(meta["id"])
        arm = arms.setdefault(name, Arm(name, meta.get("cache", ""), meta["id"]))
        arm.runs += 1
        arm.reused += sum(int(r.get("reused_blocks") or 0) for r in records)
        arm.blocks += sum(int(r.get("total_blocks") or 0) for r in records)
        if (wall := _wall(meta)) is not None:
            arm.walls.append(wall)
        if name not in firsts:
            firsts[name] = records
            continue
        diff = diff_runs(arm.first, firsts[name], meta["id"], records)
        arm.compared += 1
        arm.episodes += len(diff.episodes)
        arm.diverged += diff.diverged
        for cause in CAUSES:
            arm.causes[cause] += diff.caused(cause)
    runs_of = {m["id"]: m.get("arm", "") for m in metas}
    for job in request.app[JOBS].values():
        arm_of = arms.get(runs_of.get(job.run_b, ""))
        if arm_of is not None and job.report is not None:
            arm_of.tried += int(job.report.get("tried", 0))
            arm_of.proven += int(job.report.get("proven", 0))
    return sorted(arms.values(), key=lambda a: a.name)


def chart(arms: list[Arm]) -> dict[str, Any]:
    """Geometry of a horizontal bar chart of divergence per arm (0 to 100%)."""
    span = CHART_W - LABEL_W - 60
    bars = []
    for i, arm in enumerate(arms):
        y = 10 + i * (BAR_H + 8)
        width = round(span * arm.pct / 100, 1)
        bars.append({"arm": arm, "y": y, "w": width, "ty": y + BAR_H - 6})
    height = 30 + len(arms) * (BAR_H + 8)
    return {"bars": bars, "width": CHART_W, "height": height, "x0": LABEL_W, "span": span}


@page
async def arms_view(request: web.Request) -> web.StreamResponse:
    with redis_errors("read the runs"):
        arms = await _arms(request)
    return render(request, "arms.html", {"arms": arms, "chart": chart(arms), "causes": CAUSES})


def kind_of(reason: str) -> str:
    """A generation change's kind, for its colour on the timeline."""
    low = reason.lower()
    if "unknown" in low or "not seen" in low:
        return "unknown"
    if "reset" in low:
        return "reset"
    if "reload" in low or "restart" in low or "counter" in low or "engine" in low:
        return "reload"
    return "other"


def _timeline(events: list[dict[str, Any]], replicas: list[str]) -> dict[str, Any]:
    times = [t for e in events if (t := at_ms(e.get("at"))) is not None]
    low, high = (min(times), max(times)) if times else (0, 1)
    span = max(1, high - low)
    lanes = []
    for i, replica in enumerate(replicas):
        ticks = []
        for e in events:
            t = at_ms(e.get("at"))
            if e.get("replica") == replica and t is not None:
                x = LABEL_W + round((CHART_W - LABEL_W - 20) * (t - low) / span, 1)
                ticks.append({"x": x, "kind": kind_of(str(e.get("reason", ""))), "e": e})
        lanes.append({"replica": replica, "y": 20 + i * 30, "ticks": ticks})
    return {
        "lanes": lanes,
        "width": CHART_W,
        "height": 54 + len(replicas) * 30,
        "x0": LABEL_W,
        "low": _iso(low) if times else "",
        "high": _iso(high) if times else "",
    }


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


@page
async def fleet_view(request: web.Request) -> web.StreamResponse:
    fleet, ledger = request.app[FLEET], request.app[LEDGER]
    replicas = list(fleet)
    with redis_errors("read the fleet"):
        heads = await ledger.heads(r.id for r in replicas)
        events = await ledger.generations(count=500)
    rows = []
    for r in replicas:
        health = "healthy" if r.healthy else "down"
        if r.stalled_at is not None:
            health = "stalled"
        rows.append({"r": r, "head": heads.get(r.id), "health": health})
    ids = sorted({r.id for r in replicas} | {str(e.get("replica")) for e in events})
    context = {"rows": rows, "events": events[::-1], "timeline": _timeline(events, ids)}
    return render(request, "fleet.html", context)
