"""Replaying a snapshot's requests on a freshly reset, leased replica (DESIGN.md §3, §5).

Each replayed request steps the replica's chain and leaves a lineage record (policy
``replay``), so the run's history shows how its cache was filled. With an expected fingerprint,
the final state must equal it, else the run cannot begin: the engine, the weights or the
numerics differ from where the snapshot was made.
"""

from __future__ import annotations

import time
from typing import Any

from backends.base import BackendError, EngineStats, GenerationRequest
from router.eval.reset import ResetFailed
from router.fleet import ReplicaState
from router.ledger import ChainHead, Ledger
from router.ledger.records import Admission, Outcome, Principal, RecordInput, make_record


async def generate(replica: ReplicaState, request: GenerationRequest) -> tuple[str, EngineStats]:
    """The whole output of one request, straight from the replica."""
    pieces: list[str] = []
    stats = EngineStats()
    async for chunk in replica.backend.stream(request):
        pieces.append(chunk.text)
        if chunk.stats is not None:
            stats = chunk.stats
    return "".join(pieces), stats


async def serve_one(
    ledger: Ledger,
    replica: ReplicaState,
    run: str,
    arm: str,
    entry: dict[str, Any],
    request_id: str,
    reason: str,
) -> dict[str, Any]:
    """Serve one stored request (model, prompt, params) on ``replica`` as part of ``run``,
    stepping the chain; its record (policy ``replay``). ResetFailed when it cannot."""
    request = GenerationRequest.from_sampling(
        request_id, str(entry["prompt"]), dict(entry["params"])
    )
    head = await ledger.head(replica.id)
    started = time.perf_counter()
    try:
        output, stats = await generate(replica, request)
    except BackendError as exc:
        raise ResetFailed(f"{reason}: {exc}") from exc
    latency = time.perf_counter() - started
    parts = RecordInput(
        request=request,
        model=str(entry["model"]),
        episode=None,
        principal=Principal(arm, "eval"),
        policy="replay",
        reason=reason,
        tokens_per_block=replica.settings.tokens_per_block,
        admission=Admission(replica.id, head.generation, head.engine_digest, run=run),
    )
    record = make_record(parts, Outcome("ok", output, stats, latency, latency))
    record = await ledger.commit(record, exact=True)
    if record["pending"] or record["stale"]:
        raise ResetFailed(f"{reason}: its chain step could not run")
    return record


async def replay(
    ledger: Ledger,
    replica: ReplicaState,
    run: str,
    arm: str,
    requests: list[dict[str, Any]],
    *,
    expected: str | None,
    label: str,
) -> ChainHead:
    """Serve ``requests`` in order; the replica's head after them (checked if ``expected``)."""
    for i, entry in enumerate(requests, 1):
        reason = f"{label}, request {i} of {len(requests)}"
        await serve_one(ledger, replica, run, arm, entry, f"{run}.replay.{i}", reason)
    final = await ledger.head(replica.id)
    if expected is not None and final.state != expected:
        raise ResetFailed(
            f"{label} replayed to state {final.state[:12]}, expected {expected[:12]}: the"
            " replica's engine, weights or numerics differ from where the snapshot was made"
        )
    return final
