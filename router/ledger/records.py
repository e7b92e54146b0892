"""The lineage record of one request (DESIGN.md §5), built from the parts dispatch saw.

The builder takes plain values (the engine request, the key's principal, the policy's choice,
the admission and the outcome), not a dispatcher's flight, so the ledger depends on nothing
above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from backends.base import EngineStats, GenerationRequest
from router.ledger.chain import params_digest, request_digest, text_digest
from router.ledger.core import Ledger
from router.ledger.errors import LedgerError
from router.ledger.keys import Profile


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent the request: the key's name (never the key) and its mode."""

    name: str
    mode: str = "production"
    profile: Profile | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """The chain head a request saw when it was admitted (the response headers carry it)."""

    replica: str
    generation: int
    seq: int | None
    state: str | None
    engine_digest: str
    pending: bool
    run: str | None = None
    warning: str | None = None  # continuity broken before this request (eval)

    def headers(self, request_id: str) -> dict[str, str]:
        headers = {
            "X-Request-Id": request_id,
            "X-Kvl-Replica": self.replica,
            "X-Kvl-Generation": str(self.generation),
        }
        if self.run is not None:
            headers["X-Kvl-Run"] = self.run
        if self.warning is not None:
            headers["X-Kvl-Warning"] = self.warning
        if self.pending:
            headers["X-Kvl-Pending"] = "true"
        else:
            headers["X-Kvl-Seq"] = str(self.seq)
            headers["X-Kvl-State"] = str(self.state)
        return headers


@dataclass(frozen=True, slots=True)
class Outcome:
    status: str  # ok, error, cancelled
    output: str
    stats: EngineStats | None
    latency_s: float
    first_chunk_s: float


def _ttft_ms(stats: EngineStats | None, outcome: Outcome) -> float:
    if stats is not None and stats.first_token_ns and stats.arrival_ns:
        return round((stats.first_token_ns - stats.arrival_ns) / 1e6, 3)
    return round(outcome.first_chunk_s * 1000, 3)


@dataclass(frozen=True, slots=True)
class RecordInput:
    """What a record is made of besides its outcome."""

    request: GenerationRequest
    model: str
    episode: str | None
    principal: Principal
    policy: str
    reason: str
    tokens_per_block: int
    admission: Admission


def make_record(parts: RecordInput, outcome: Outcome) -> dict[str, Any]:
    """Every field of DESIGN.md §5; ``state_after`` is filled when the chain advances."""
    request, principal, admission = parts.request, parts.principal, parts.admission
    stats = outcome.stats or EngineStats()
    sampling = request.sampling()
    evaluating = admission.run is not None
    return {
        "request_id": request.request_id,
        "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "key": principal.name,
        "mode": principal.mode,
        "arm": principal.name if evaluating else None,
        "run": admission.run,
        "episode": parts.episode,
        "replica": admission.replica,
        "model": parts.model,
        "engine_digest": admission.engine_digest,
        "generation": admission.generation,
        "seq": admission.seq,
        "state_before": admission.state,
        "state_after": None,
        "exact": evaluating,
        "verified": None,
        "warning": admission.warning,
        "pending": admission.pending,
        "digest": request_digest(parts.model, request.prompt, sampling, outcome.output),
        "prompt_digest": text_digest(request.prompt),
        "params_digest": params_digest(sampling),
        "output_digest": text_digest(outcome.output),
        "reused_blocks": stats.reused_blocks,
        "total_blocks": stats.total_blocks,
        "new_blocks": stats.new_blocks,
        "cached_tokens": stats.reused_blocks * parts.tokens_per_block,
        "prompt_tokens": stats.input_tokens,
        "completion_tokens": stats.output_tokens,
        "status": outcome.status,
        "latency_ms": round(outcome.latency_s * 1000, 3),
        "ttft_ms": _ttft_ms(outcome.stats, outcome),
        "policy": parts.policy,
        "reason": parts.reason,
    }


async def commit(ledger: Ledger, record: dict[str, Any]) -> None:
    """Advance the replica's chain by this request and queue its record.

    While Redis answers, the chain step is one Lua call and the record is written behind the
    response. When it does not, the record keeps ``state_after: null, pending: true`` and goes to
    the ledger's buffer and spool with its chain step, which runs in spool order once Redis is back.
    """
    if not record["pending"] and ledger.redis_up:
        try:
            step = await ledger.advance(
                record["replica"],
                record["generation"],
                record["digest"],
                request_id=record["request_id"],
            )
        except LedgerError:
            pass
        else:
            record["state_after"] = step.state_after
            record["exact"] = record["exact"] and not step.stale
            ledger.submit(record)
            return
    record["pending"] = True
    ledger.submit_pending(record)
