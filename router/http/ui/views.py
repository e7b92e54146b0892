"""The Runs list, one run's requests a page at a time, and one request with its input and output.

A run's page reads one page of its index stream (``RecordPages.run_page``: ``XRANGE`` with a
``COUNT``), so a run of 100,000 requests opens as fast as a run of ten. The list counts each
run's records with ``XLEN``; the verified share needs every record, so it is computed for runs
up to ``SHARE_LIMIT`` requests and shown on demand (the run's page) for larger ones.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.errors import BadRequest, NotFound
from router.eval.failover import moves
from router.http.admin import redis_errors
from router.http.context import REDIS, RUNS
from router.http.ui.auth import page, render
from router.ledger.export import STREAM_ID, RecordPages

RUNS_PER_PAGE = 25
REQUESTS_PER_PAGE = 100
MAX_PER_PAGE = 1_000
SHARE_LIMIT = 2_000
ARM_SCAN = 5_000


def pages(request: web.Request) -> RecordPages:
    return RecordPages(request.app[REDIS])


def number(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, "")
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 1_000_000:
        raise BadRequest(f"'{name}' must be a whole number from 1", param=name)
    return int(raw)


def cursor(request: web.Request, name: str) -> str | None:
    raw = request.query.get(name) or None
    if raw is not None and not STREAM_ID.fullmatch(raw):
        raise BadRequest(f"'{name}' must be a stream entry id such as 1733400000000-0")
    return raw


async def _share(reader: RecordPages, run: str, requests: int) -> float | None:
    if requests == 0 or requests > SHARE_LIMIT:
        return None
    verified = total = 0
    async for records in reader.run_records(run):
        total += len(records)
        verified += sum(1 for r in records if r.get("verified") is True)
    return verified / total if total else None


@page
async def runs_list(request: web.Request) -> web.StreamResponse:
    arm = request.query.get("arm") or None
    at = number(request, "page", 1)
    reader = pages(request)
    with redis_errors("list runs"):
        wanted = ARM_SCAN if arm else at * RUNS_PER_PAGE + 1
        runs = await request.app[RUNS].store.recent(wanted)
        arms = sorted({r.get("arm", "") for r in runs} - {""})
        if arm:
            runs = [r for r in runs if r.get("arm") == arm]
        shown = runs[(at - 1) * RUNS_PER_PAGE : at * RUNS_PER_PAGE]
        rows = []
        for meta in shown:
            count = await reader.run_length(meta["id"])
            share = await _share(reader, meta["id"], count)
            rows.append(
                {"meta": meta, "requests": count, "share": share, "moves": len(moves(meta))}
            )
    more = len(runs) > at * RUNS_PER_PAGE
    context = {"rows": rows, "arm": arm or "", "arms": arms, "page": at, "more": more}
    return render(request, "runs.html", context)


@page
async def run_view(request: web.Request) -> web.StreamResponse:
    run = request.match_info["id"]
    after, before = cursor(request, "after"), cursor(request, "before")
    size = min(number(request, "count", REQUESTS_PER_PAGE), MAX_PER_PAGE)
    reader = pages(request)
    with redis_errors("read the run"):
        meta = await request.app[RUNS].store.get(run)
        count = await reader.run_length(run)
        if meta is None and count == 0:
            raise NotFound(f"no run '{run}'")
        shown = await reader.run_page(run, size, after=after, before=before)
    rows = [{"entry": entry, "r": record} for entry, record in shown.entries]
    context = {
        "run": run,
        "meta": meta or {},
        "moves": moves(meta or {}),
        "count": count,
        "rows": rows,
        "page": shown,
        "size": "" if size == REQUESTS_PER_PAGE else f"&count={size}",
    }
    return render(request, "run.html", context)


@page
async def request_view(request: web.Request) -> web.StreamResponse:
    run, entry = request.match_info["id"], request.match_info["entry"]
    if not STREAM_ID.fullmatch(entry):
        raise BadRequest("not a stream entry id")
    reader = pages(request)
    with redis_errors("read the request"):
        record = await reader.run_entry(run, entry)
        if record is None:
            raise NotFound(f"run '{run}' has no entry {entry}")
        kept = await reader.find_input(run, str(record.get("request_id")), entry)
    fields: list[tuple[str, Any]] = sorted(record.items())
    context = {"run": run, "record": record, "fields": fields, "kept": kept or {}}
    return render(request, "request.html", context)
