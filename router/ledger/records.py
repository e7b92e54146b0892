"""The lineage record of one request (DESIGN.md §5), built from the parts dispatch saw.

The builder takes plain values (the engine request, the key's principal, the policy's choice,
the admission and the outcome), not a dispatcher's flight, so the ledger depends on nothing
above it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from backends.base import EngineStats, GenerationRequest
from router.ledger.chain import Advance, RequestDigest, params_digest, text_digest
from router.ledger.keys import Profile

_second: list[Any] = [None, ""]  # the last whole second stamped, and its text
_MILLIS = [f".{m:03d}+00:00" for m in range(1000)]  # a stamp's tail, formatted once


def stamp(now: float | None = None) -> str:
    """``now`` (default: the time now) as ISO 8601 UTC to the millisecond
    (``2026-12-03T21:04:37.826+00:00``, as ``datetime.isoformat(timespec="milliseconds")``);
    the date and time formatted once a second (isoformat alone cost 2.3 us, on every record)."""
    if now is None:
        now = time.time()
    second = int(now)
    micros = round((now - second) * 1e6)  # as datetime: to the microsecond, half to even
    if micros == 1_000_000:
        second, micros = second + 1, 0
    if second != _second[0]:
        text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second[:] = second, text
    head: str = _second[1]
    return head + _MILLIS[micros // 1000]


@dataclass(slots=True)
class Principal:
    """Who sent the request: the key's name (never the key) and its mode."""

    name: str
    mode: str = "production"
    profile: Profile | None = None


@dataclass(slots=True)
class Admission:
    """What the proxy knows when a request is admitted: the replica and the generation it
    knows locally; an eval request also knows the head under its turn (``seq``, ``state``)."""

    replica: str
    generation: int
    engine_digest: str
    run: str | None = None
    warning: str | None = None  # continuity broken before this request (eval)
    seq: int | None = None
    state: str | None = None

    def headers(self, request_id: str) -> dict[str, str]:
        """A stream's headers, sent before the chain steps (the last event carries the state)."""
        headers = {
            "X-Request-Id": request_id,
            "X-Kvl-Replica": self.replica,
            "X-Kvl-Generation": str(self.generation),
        }
        if self.seq is not None and self.state is not None:
            headers["X-Kvl-Seq"] = str(self.seq)
            headers["X-Kvl-State"] = self.state
        return _eval_headers(headers, self.run, self.warning)


def record_headers(record: dict[str, Any]) -> dict[str, str]:
    """A JSON response's headers, from its record: the state the request's step advanced from."""
    headers = {
        "X-Request-Id": str(record["request_id"]),
        "X-Kvl-Replica": str(record["replica"]),
        "X-Kvl-Generation": str(record["generation"]),
    }
    if record["pending"]:
        headers["X-Kvl-Pending"] = "true"
    elif record["state_before"] is not None:
        headers["X-Kvl-Seq"] = str(record["seq"])
        headers["X-Kvl-State"] = str(record["state_before"])
    return _eval_headers(headers, record["run"], record["warning"])


def _eval_headers(headers: dict[str, str], run: str | None, warning: str | None) -> dict[str, str]:
    if run is not None:
        headers["X-Kvl-Run"] = run
    if warning is not None:
        headers["X-Kvl-Warning"] = warning
    return headers


@dataclass(slots=True)
class Outcome:
    status: str  # ok, error, cancelled
    output: str
    stats: EngineStats | None
    latency_s: float
    first_chunk_s: float


_NO_STATS = EngineStats()  # a request that ended before the engine said anything


def _ttft_ms(stats: EngineStats | None, outcome: Outcome) -> float:
    if stats is not None and stats.first_token_ns and stats.arrival_ns:
        return round((stats.first_token_ns - stats.arrival_ns) / 1e6, 3)
    return round(outcome.first_chunk_s * 1000, 3)


@dataclass(slots=True)
class Draft:
    """What a record takes from its request alone: hashed once the replica has the request,
    while it works, not after its answer (see :meth:`RecordInput.draft`)."""

    digest: RequestDigest
    prompt_digest: str
    params_digest: str


@dataclass(slots=True)
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
    drafted: Draft | None = None

    def draft(self) -> Draft:
        """The request's part of the record, computed on the first call. A flight calls it
        when its request is on its way to the replica (``router.flight.take_off``), so that
        the hashing is done before the answer comes; a record made otherwise computes it
        when it is made."""
        drafted = self.drafted
        if drafted is None:
            request = self.request
            sampling = request.sampling()
            digest = RequestDigest(self.model, request.prompt, sampling)
            drafted = Draft(digest, text_digest(request.prompt), params_digest(sampling))
            self.drafted = drafted
        return drafted


def cached_tokens(stats: EngineStats, tokens_per_block: int) -> int:
    """An estimate from blocks: reused blocks x block size, at most the prompt less its last
    token (the engine always computes that one). With partial reuse (TensorRT-LLM's default) a
    partly matched block counts as reused whole, so the product alone can pass the prompt."""
    estimate = stats.reused_blocks * tokens_per_block
    if stats.input_tokens > 0:
        return min(estimate, stats.input_tokens - 1)
    return estimate


def make_record(parts: RecordInput, outcome: Outcome) -> dict[str, Any]:
    """Every field of DESIGN.md §5 but the chain fields (``CHAIN_FIELDS``), which the ledger
    adds when the chain steps (or sets to None while the step waits for Redis)."""
    request, principal, admission = parts.request, parts.principal, parts.admission
    stats = outcome.stats or _NO_STATS
    draft = parts.draft()
    evaluating = admission.run is not None
    return {
        "request_id": request.request_id,
        "at": stamp(),
        "key": principal.name,
        "mode": principal.mode,
        "arm": principal.name if evaluating else None,
        "run": admission.run,
        "episode": parts.episode,
        "replica": admission.replica,
        "model": parts.model,
        "engine_digest": admission.engine_digest,
        "generation": admission.generation,
        "verified": None,
        "warning": admission.warning,
        "pending": False,
        "digest": draft.digest.of(outcome.output),
        "prompt_digest": draft.prompt_digest,
        "params_digest": draft.params_digest,
        "output_digest": text_digest(outcome.output),
        "reused_blocks": stats.reused_blocks,
        "total_blocks": stats.total_blocks,
        "new_blocks": stats.new_blocks,
        "cached_tokens": cached_tokens(stats, parts.tokens_per_block),
        "prompt_tokens": stats.input_tokens,
        "completion_tokens": stats.output_tokens,
        "status": outcome.status,
        "latency_ms": round(outcome.latency_s * 1000, 3),
        "ttft_ms": _ttft_ms(outcome.stats, outcome),
        "policy": parts.policy,
        "reason": parts.reason,
    }


# Set by the chain step, in this order (the step script appends exactly these bytes).
CHAIN_FIELDS = ("seq", "state_before", "state_after", "state_known", "stale", "unordered", "exact")


def template(record: dict[str, Any]) -> bytes:
    """The record as JSON without its chain fields, for the step script to complete."""
    if "seq" not in record:  # as make_record built it
        return orjson.dumps(record)
    return orjson.dumps({k: v for k, v in record.items() if k not in CHAIN_FIELDS})


def chain_fields(step: Advance, exact: bool) -> dict[str, Any]:
    """The chain fields of a record whose step answered ``step``."""
    return {
        "seq": step.seq,
        "state_before": step.state_before,
        "state_after": step.state_after,
        "state_known": step.known,
        "stale": step.stale,
        "unordered": step.unordered,
        "exact": exact and not step.stale and not step.unordered,
    }


def with_chain(data: bytes, fields: dict[str, Any]) -> bytes:
    """The template completed by ``fields``: byte for byte what the step script stores."""
    return (
        data[:-1]
        + b"".join(
            b',"' + name.encode() + b'":' + orjson.dumps(fields[name]) for name in CHAIN_FIELDS
        )
        + b"}"
    )
