"""Snapshots (DESIGN.md §3): an ordered list of complete requests and the fingerprint it makes.

From a run: the run's recorded requests (``kvl:{run:ID}:requests``), up to ``upto``; the run
must have begun from a known state (a verified reset, or a snapshot's replay, whose requests
then come first) and each request must be complete and verified, else the fingerprint would
not be reproducible. From a list of requests: the proxy leases a replica for an internal run,
resets it, replays the list and records the fingerprint it reached.
"""

from __future__ import annotations

from typing import Any

from router.errors import BadRequest, NotFound
from router.eval.profiles import REPLAY, now_iso
from router.eval.replay import replay
from router.eval.runs import Runs
from router.fleet import Fleet
from router.ledger import Ledger
from router.ledger.keys import Profile
from router.ledger.runs import RunStore

Snapshot = dict[str, Any]


def summary(snapshot: Snapshot) -> dict[str, Any]:
    """Everything but the requests."""
    return {k: v for k, v in snapshot.items() if k != "requests"}


async def from_run(store: RunStore, name: str, run: str, upto: int | None) -> Snapshot:
    meta = await store.get(run)
    if meta is None:
        raise NotFound(f"no run '{run}'")
    cache = meta.get("cache", "")
    base: list[dict[str, Any]] = []
    if cache.startswith(REPLAY):
        parent = await store.snapshot(cache[len(REPLAY) :])
        if parent is None:
            raise BadRequest(f"run {run} replayed snapshot '{cache}', which no longer exists")
        base = list(parent["requests"])
    elif cache != "reset":
        raise BadRequest(
            f"run {run} has cache '{cache}': it did not begin from a reset, so its requests"
            " do not say what was in the cache"
        )
    entries = await store.requests(run)
    if upto is not None:
        if not 1 <= upto <= len(entries):
            raise BadRequest(f"--upto must be 1 to {len(entries)}: run {run} has that many")
        entries = entries[:upto]
    if not entries:
        raise BadRequest(f"run {run} has no requests to snapshot")
    expected = meta.get("state")
    for i, entry in enumerate(entries, 1):
        if entry.get("status") != "ok" or not entry.get("verified"):
            raise BadRequest(
                f"request {i} of run {run} ({entry.get('request_id')}) was"
                f" {'not verified' if entry.get('status') == 'ok' else entry.get('status')}:"
                " its effect on the cache cannot be replayed; use --upto to stop before it"
            )
        if entry.get("state_before") != expected:
            raise BadRequest(f"request {i} of run {run} does not continue the run's chain")
        expected = entry.get("state_after")
    requests = base + [
        {"model": e["model"], "prompt": e["prompt"], "params": e["params"]} for e in entries
    ]
    return _snapshot(name, f"run {run}", requests, str(expected), meta["engine_digest"])


async def from_requests(
    runs: Runs, fleet: Fleet, ledger: Ledger, name: str, model: str, requests: list[Any]
) -> Snapshot:
    """Replay ``requests`` after a verified reset on a leased replica; record where it ends."""
    arm = f"snapshot.{name}"
    meta = await runs.begin(Profile(name=arm, mode="eval", cache="reset"), model)
    replica = fleet[meta["replica"]]
    try:
        label = f"snapshot '{name}'"
        head = await replay(ledger, replica, meta["id"], arm, requests, expected=None, label=label)
    finally:
        await runs.end(meta["id"], "snapshot recorded")
    return _snapshot(
        name,
        f"{len(requests)} requests (run {meta['id']})",
        requests,
        head.state,
        head.engine_digest,
    )


def _snapshot(
    name: str, source: str, requests: list[Any], fingerprint: str, engine_digest: str
) -> Snapshot:
    return {
        "name": name,
        "created_at": now_iso(),
        "source": source,
        "count": len(requests),
        "fingerprint": fingerprint,
        "engine_digest": engine_digest,
        "requests": requests,
    }
