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
from router.ledger.chain import request_digest
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
    head = await ledger.head(replica.id)
    principal = Principal(arm, "eval")
    for i, entry in enumerate(requests, 1):
        request = GenerationRequest.from_sampling(
            f"{run}.replay.{i}", str(entry["prompt"]), dict(entry["params"])
        )
        started = time.perf_counter()
        try:
            output, stats = await generate(replica, request)
        except BackendError as exc:
            raise ResetFailed(f"replaying {label}, request {i}: {exc}") from exc
        latency = time.perf_counter() - started
        digest = request_digest(str(entry["model"]), request.prompt, request.sampling(), output)
        step = await ledger.advance(
            replica.id, head.generation, digest, request_id=request.request_id
        )
        admission = Admission(
            replica.id,
            step.generation,
            step.seq - 1,
            step.state_before,
            head.engine_digest,
            False,
            run=run,
        )
        parts = RecordInput(
            request=request,
            model=str(entry["model"]),
            episode=None,
            principal=principal,
            policy="replay",
            reason=f"{label}, request {i} of {len(requests)}",
            tokens_per_block=replica.settings.tokens_per_block,
            admission=admission,
        )
        record = make_record(parts, Outcome("ok", output, stats, latency, latency))
        record.update(state_after=step.state_after, exact=not step.stale, verified=None)
        ledger.submit(record)
    final = await ledger.head(replica.id)
    if expected is not None and final.state != expected:
        raise ResetFailed(
            f"{label} replayed to state {final.state[:12]}, expected {expected[:12]}: the"
            " replica's engine, weights or numerics differ from where the snapshot was made"
        )
    return final
