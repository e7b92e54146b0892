"""Two runs side by side at their first divergence, and ``runs explain`` as a background job.

The baseline (``a``) is pinned, the candidate (``b``) is compared with it by
``router.eval.diff.diff_runs``, the rule ``kvledger runs diff`` uses, so the page and the
command classify every episode alike. For each diverged episode the page shows both
trajectories up to the first differing request, that request's two outputs with the first
differing character marked, and the serving-side facts of both sides next to each other.

Explain takes a verified reset and a replay per chain (minutes), so the button starts an
``Explainer`` task and redirects to its job page, which reloads itself (a meta refresh: the
page runs no script) until the verdict is in. Jobs live in this proxy process.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from router.errors import BadRequest, KvlError, NotFound
from router.eval.diff import EpisodeDiff, diff_runs
from router.eval.explain import Explainer
from router.http.admin import redis_errors
from router.http.context import LEDGER, RUNS
from router.http.ui.auth import page, render, see_other
from router.http.ui.views import pages
from router.ledger import LedgerError

Record = dict[str, Any]
FACTS = ("replica", "generation", "seq", "state_before", "reused_blocks", "cached_tokens")
MAX_JOBS = 100


@dataclass
class Job:
    id: str
    run_a: str
    run_b: str
    episode: str | None
    events: list[dict[str, Any]] = field(default_factory=list)
    status: str = "running"  # running, done, failed
    report: dict[str, Any] | None = None
    error: str | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)


JOBS = web.AppKey("ui_jobs", dict[str, Job])


async def jobs_ctx(app: web.Application) -> AsyncIterator[None]:
    app[JOBS] = {}
    yield
    tasks = [j.task for j in app[JOBS].values() if j.task is not None and not j.task.done()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _group(records: list[Record], by_episode: bool) -> dict[str, list[Record]]:
    if not by_episode:
        return {"-": records}
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(str(record["episode"]), []).append(record)
    return groups


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (the shorter's length if one
    is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _split(text: str | None, at: int) -> dict[str, Any] | None:
    if text is None:
        return None
    return {"same": text[:at], "mark": text[at : at + 1], "rest": text[at + 1 :]}


def _facts(ra: Record | None, rb: Record | None) -> list[dict[str, Any]]:
    out = []
    for name in FACTS:
        va = None if ra is None else ra.get(name)
        vb = None if rb is None else rb.get(name)
        out.append({"name": name, "a": va, "b": vb, "differs": va != vb})
    return out


def _episode(
    e: EpisodeDiff, a: list[Record], b: list[Record], kept: tuple[dict[str, Record], ...]
) -> dict[str, Any]:
    upto = 0 if e.position is None else e.position
    steps = []
    for i in range(upto + 1 if e.position is not None else 0):
        ra = a[i] if i < len(a) else None
        rb = b[i] if i < len(b) else None
        steps.append({"position": i, "facts": _facts(ra, rb), "first": i == e.position})
    out_a = kept[0].get(str(e.request_a), {}).get("output") if e.request_a else None
    out_b = kept[1].get(str(e.request_b), {}).get("output") if e.request_b else None
    at = first_difference(out_a or "", out_b or "")
    return {
        "e": e,
        "steps": steps,
        "out_a": _split(out_a, at),
        "out_b": _split(out_b, at),
        "char": at,
    }


@page
async def compare(request: web.Request) -> web.StreamResponse:
    run_a, run_b = request.query.get("a", ""), request.query.get("b", "")
    if not run_a or not run_b:
        raise BadRequest("pick a baseline (a) and a candidate (b) on the Runs page")
    show_all = request.query.get("all") == "1"
    ledger, store = request.app[LEDGER], request.app[RUNS].store
    with redis_errors("read the runs"):
        metas = [await store.get(run_a), await store.get(run_b)]
        for run, meta in zip((run_a, run_b), metas, strict=True):
            if meta is None:
                raise NotFound(f"no run '{run}'")
        records_a, records_b = await ledger.run_records(run_a), await ledger.run_records(run_b)
        reader = pages(request)
        kept = (await reader.inputs(run_a), await reader.inputs(run_b))
    diff = diff_runs(run_a, records_a, run_b, records_b)
    by_episode = diff.aligned_by == "episode"
    groups_a, groups_b = _group(records_a, by_episode), _group(records_b, by_episode)
    episodes = [
        _episode(e, groups_a.get(e.episode, []), groups_b.get(e.episode, []), kept)
        for e in diff.episodes
        if show_all or e.kind != "identical"
    ]
    jobs = [j for j in request.app[JOBS].values() if (j.run_a, j.run_b) == (run_a, run_b)]
    context = {
        "a": run_a,
        "b": run_b,
        "meta_a": metas[0],
        "meta_b": metas[1],
        "diff": diff,
        "counts": diff.counts(),
        "episodes": episodes,
        "show_all": show_all,
        "jobs": jobs,
    }
    return render(request, "compare.html", context)


@page
async def start_explain(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    run_a, run_b, episode = form.get("a"), form.get("b"), form.get("episode") or None
    if not isinstance(run_a, str) or not isinstance(run_b, str) or not run_a or not run_b:
        raise BadRequest("explain needs two runs, a and b")
    if episode is not None and not isinstance(episode, str):
        raise BadRequest("'episode' must be text")
    jobs = request.app[JOBS]
    if sum(1 for j in jobs.values() if j.status == "running") >= 4:
        raise BadRequest("four explanations are running already; wait for one to finish")
    with redis_errors("read the runs"):
        for run in (run_a, run_b):
            if await request.app[RUNS].store.get(run) is None:
                raise NotFound(f"no run '{run}'")
    job = Job(secrets.token_hex(8), run_a, run_b, episode)
    for old in [j for j in jobs.values() if j.status != "running"][: max(0, len(jobs) - MAX_JOBS)]:
        del jobs[old.id]
    jobs[job.id] = job
    job.task = asyncio.create_task(_explain(request.app, job), name=f"kvl-ui-explain-{job.id}")
    return see_other(f"/ui/explain/{job.id}")


async def _explain(app: web.Application, job: Job) -> None:
    async def emit(event: dict[str, Any]) -> None:
        job.events.append(event)

    try:
        job.report = await Explainer(app[RUNS], emit).explain(
            job.run_a, job.run_b, episode=job.episode, limit=None
        )
        job.status = "done"
    except KvlError as exc:
        job.status, job.error = "failed", exc.message
    except LedgerError as exc:
        job.status, job.error = "failed", f"Redis: {exc}"


@page
async def explain_job(request: web.Request) -> web.StreamResponse:
    job = request.app[JOBS].get(request.match_info["id"])
    if job is None:
        raise NotFound("no such explanation (jobs live in the proxy that ran them)")
    return render(request, "explain.html", {"job": job})
