"""The verified reset (DESIGN.md §5): the only way to empty a TensorRT-LLM replica's KV cache.

Steps: stop admitting (locally at once; other proxies see the Redis mark within one monitor
interval, which is why the wait lasts at least ``settle_s``), wait until the replica holds no
request from anyone (the engine's active-request gauge, so other proxies' and direct clients'
requests count too), unload with dependents and load through the repository API, wait until
ready, confirm that the engine model's request counter and its used-blocks gauge read zero,
then raise the generation: seq 0, state genesis, and a ``kvl:generations`` entry with the
reason and the durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import structlog

from backends.base import BackendError
from router.fleet import ReplicaState
from router.ledger import Ledger, LedgerError
from router.ledger.turns import Turns

_log = structlog.get_logger("kvledger.reset")


class ResetFailed(Exception):
    """The replica could not be reset and verified; the message says which step failed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class ResetReport:
    replica: str
    generation: int
    state: str
    waited_s: float  # stopping admission until the replica was idle
    reload_s: float  # unload, load, ready, counters confirmed
    total_s: float

    def as_fields(self) -> dict[str, str]:
        return {
            "reset_generation": str(self.generation),
            "reset_waited_ms": f"{self.waited_s * 1000:.0f}",
            "reset_reload_ms": f"{self.reload_s * 1000:.0f}",
            "reset_ms": f"{self.total_s * 1000:.0f}",
        }


async def wait_idle(replica: ReplicaState, settle_s: float, timeout_s: float) -> float:
    """Seconds until nothing runs on the replica (and at least ``settle_s``), or ResetFailed."""
    began = time.monotonic()
    while True:
        try:
            counters = await replica.backend.counters()
        except BackendError as exc:
            raise ResetFailed(f"replica {replica.id} did not answer: {exc.detail}") from exc
        if not counters.ready:
            raise ResetFailed(f"replica {replica.id} is not ready")
        busy = replica.in_flight + int(counters.active)
        waited = time.monotonic() - began
        if busy == 0 and waited >= settle_s:
            return waited
        if waited > timeout_s:
            raise ResetFailed(
                f"replica {replica.id} still has {busy} request(s) in flight after {timeout_s:g} s"
            )
        await asyncio.sleep(0.05)


async def verified_reset(
    replica: ReplicaState,
    ledger: Ledger,
    turns: Turns,
    *,
    reason: str,
    settle_s: float,
    drain_timeout_s: float,
    run: str | None = None,
) -> ResetReport:
    """Reset ``replica`` and prove it (see the module docstring); ResetFailed says why not."""
    started = time.perf_counter()
    replica.reset_here = True
    try:
        try:
            await turns.mark_resetting(replica.id, int((drain_timeout_s + 300) * 1000))
        except LedgerError as exc:
            raise ResetFailed(f"cannot mark the reset in Redis: {exc}") from exc
        waited = await wait_idle(replica, settle_s, drain_timeout_s)
        reload_started = time.perf_counter()
        digest = await _reload(replica)
        reload_s = time.perf_counter() - reload_started
        total_s = time.perf_counter() - started
        details = {
            "duration_ms": f"{total_s * 1000:.0f}",
            "reload_ms": f"{reload_s * 1000:.0f}",
            "waited_ms": f"{waited * 1000:.0f}",
        }
        if run is not None:
            details["run"] = run
        try:
            head = await ledger.new_generation(replica.id, digest, reason, details)
        except LedgerError as exc:
            raise ResetFailed(f"reset done, but Redis did not take the generation: {exc}") from exc
        replica.generation, replica.engine_digest = head.generation, digest
        replica.counters = None  # the next monitor tick starts a new baseline
        _log.info("replica_reset", replica=replica.id, generation=head.generation, **details)
        return ResetReport(replica.id, head.generation, head.state, waited, reload_s, total_s)
    finally:
        replica.reset_here = False
        with contextlib.suppress(LedgerError):
            await turns.clear_resetting(replica.id)


async def _reload(replica: ReplicaState) -> str:
    """Unload and load; then the model must be ready, and the engine model's request counter
    and TensorRT-LLM's used-blocks gauge must both read zero (a fresh engine, an empty cache)."""
    backend = replica.backend
    try:
        await backend.reset()
        counters = await backend.counters()
        if not counters.ready:
            raise ResetFailed(f"replica {replica.id}: the model did not come back ready")
        if counters.request_count != 0:
            raise ResetFailed(
                f"replica {replica.id}: request counter reads {counters.request_count} after the"
                " reload, not 0; the model was not reloaded, so its cache may not be empty"
            )
        if counters.used_blocks != 0:
            raise ResetFailed(
                f"replica {replica.id}: the engine reports {counters.used_blocks:g} KV-cache"
                " blocks in use after the reload, not 0; its cache may not be empty"
            )
        return await backend.engine_digest()
    except BackendError as exc:
        raise ResetFailed(f"replica {replica.id}: {exc.detail}") from exc
