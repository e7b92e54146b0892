"""Read what the ledger stored, from a synchronous test, through the ledger's own readers."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from router.ledger import Ledger, LedgerConfig
from router.ledger.chain import genesis
from router.ledger.connect import connect

T = TypeVar("T")


class LedgerView:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.spool = Path(tempfile.mkdtemp(prefix="kvl-view-")) / "spool.jsonl"

    def _run(self, use: Callable[[Ledger], Awaitable[T]]) -> T:
        async def go() -> T:
            client = connect(self.redis_url, timeout_s=10, connect_timeout_s=5)
            ledger = Ledger(client, LedgerConfig(spool_path=self.spool), structlog.get_logger())
            try:
                return await use(ledger)
            finally:
                await client.aclose()

        return asyncio.run(go())

    def record(self, request_id: str) -> dict[str, Any] | None:
        return self._run(lambda ledger: ledger.record(request_id))

    def tail(self, count: int = 1000, **filters: str) -> list[dict[str, Any]]:
        return self._run(lambda ledger: ledger.tail(count, **filters))

    def head(self, replica: str) -> dict[str, Any]:
        head = self._run(lambda ledger: ledger.head(replica))
        return {
            "generation": head.generation,
            "seq": head.seq,
            "state": head.state,
            "engine_digest": head.engine_digest,
        }

    def generations(self, replica: str | None = None) -> list[dict[str, Any]]:
        return self._run(lambda ledger: ledger.generations(replica))

    @staticmethod
    def genesis(engine_digest: str) -> str:
        return genesis(engine_digest)
