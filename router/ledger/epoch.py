"""The ledger's epoch: which Redis history a proxy is writing into.

``kvl:epoch`` holds ``{"id", "created_at", "previous", "previous_seen_at"}`` (JSON), created
once with ``SET NX`` and never changed; ``kvl:epochs`` (a stream) lists every epoch created,
oldest first. Each proxy remembers the epoch it found at start. When the key is gone or holds
another id (Redis restarted without persistence, a FLUSHALL, a failover to an empty replica),
the history the proxy wrote is gone: the proxy creates the next epoch (``previous`` names the
lost one and when this proxy last saw it), logs ``ledger_epoch_lost`` and counts it. After such
a loss, ``created_at`` of the current epoch is where the ledger's history starts.

The check is one ``GET`` and runs on the monitor's tick and when the writer finds Redis back,
never on a request's path.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from router.ledger.errors import redis_call
from router.ledger.records import stamp
from router.ledger.schema import EPOCH, EPOCHS, text

LOST_REASON = "Redis lost its data"


@dataclass(frozen=True, slots=True)
class EpochInfo:
    id: str
    created_at: str
    previous: str | None = None
    previous_seen_at: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {
            "id": self.id,
            "created_at": self.created_at,
            "previous": self.previous,
            "previous_seen_at": self.previous_seen_at,
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.as_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> EpochInfo:
        data: dict[str, Any] = orjson.loads(raw)
        return cls(
            str(data["id"]),
            str(data.get("created_at", "")),
            data.get("previous"),
            data.get("previous_seen_at"),
        )


@dataclass(frozen=True, slots=True)
class EpochLoss:
    """The epoch this proxy remembered is gone; ``current`` replaced it."""

    lost: EpochInfo
    current: EpochInfo
    seen_at: str  # when this proxy last saw the lost one


class Epoch:
    """The epoch one proxy remembers (``known``), and its check against Redis."""

    def __init__(self, client: aioredis.Redis, timeout_s: float = 2.0) -> None:
        self._client = client
        self._timeout = timeout_s
        self._lock = asyncio.Lock()
        self.known: EpochInfo | None = None
        self.seen_at = ""  # when ``known`` was last read from Redis
        self.losses = 0

    @property
    def id(self) -> str | None:
        return None if self.known is None else self.known.id

    async def check(self) -> EpochLoss | None:
        """Read the epoch (creating it when absent); the loss when it is not the one known.
        Raises LedgerUnavailable when Redis does not answer."""
        async with self._lock:
            current = await self._read()
            known = self.known
            if current is not None and known is not None and current.id == known.id:
                self.seen_at = stamp()
                return None
            if current is None:
                if known is None:
                    current = await self._create(None, None)
                else:
                    current = await self._create(known.id, self.seen_at or None)
            self.known = current
            lost_at, self.seen_at = self.seen_at, stamp()
            if known is None:
                return None
            self.losses += 1
            return EpochLoss(known, current, lost_at)

    async def _read(self) -> EpochInfo | None:
        async with redis_call("read epoch", self._timeout):
            raw = await self._client.get(EPOCH)
        return None if raw is None else EpochInfo.from_json(raw)

    async def _create(self, previous: str | None, previous_seen_at: str | None) -> EpochInfo:
        """A new epoch, unless another proxy created one first (then that one)."""
        info = EpochInfo(secrets.token_hex(8), stamp(), previous, previous_seen_at)
        async with redis_call("create epoch", self._timeout):
            if await self._client.set(EPOCH, info.to_json(), nx=True):
                fields = {k: v or "" for k, v in orjson.loads(info.to_json()).items()}
                await self._client.xadd(EPOCHS, fields)
                return info
            raw = await self._client.get(EPOCH)
        return info if raw is None else EpochInfo.from_json(raw)


async def read_epochs(client: aioredis.Redis, timeout_s: float = 5.0) -> list[EpochInfo]:
    """Every epoch ``kvl:epochs`` lists, oldest first, ending with the current one (for
    ``kvledger audit chain``); empty when the ledger has none (written before epochs)."""
    async with redis_call("read epochs", timeout_s):
        entries: Any = await client.xrange(EPOCHS)
        raw = await client.get(EPOCH)
    epochs = []
    for _, fields in entries or []:
        f = {text(k): text(v) for k, v in (fields or {}).items()}
        epochs.append(
            EpochInfo(
                f.get("id", ""),
                f.get("created_at", ""),
                f.get("previous") or None,
                f.get("previous_seen_at") or None,
            )
        )
    if raw is not None:
        current = EpochInfo.from_json(raw)
        if not epochs or epochs[-1].id != current.id:
            epochs.append(current)
    return epochs
