"""The ledger's errors, and the one place where Redis errors become them.

::

    LedgerError                 the ledger cannot do what was asked
     ├── LedgerUnavailable      Redis did not answer within redis_timeout_s, or refused the
     │                          command; retry later (production degrades to pending records)
     ├── UnknownReplica         the replica has no chain in Redis yet (call ensure_replica)
     └── SpoolUnavailable       start(): the spool file cannot be opened, or another process
                                holds it

``submit`` and ``submit_pending`` never raise: a record is dropped (and counted, and logged as
``ledger_record_dropped``) only when the spool's disk write fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

# What a Redis call can raise when the server is away, slow or refusing: redis-py's errors,
# socket errors it lets through, and our own deadline.
REDIS_FAILURES = (RedisError, OSError, TimeoutError)


class LedgerError(Exception):
    """Base of the ledger's errors."""


class LedgerUnavailable(LedgerError):
    """Redis is unreachable, too slow or refused; the message says which call."""


class UnknownReplica(LedgerError):
    """The replica has no chain yet."""


class SpoolUnavailable(LedgerError):
    """The local spool cannot be used."""


def unavailable(what: str, exc: BaseException) -> LedgerUnavailable:
    """The LedgerUnavailable that a Redis failure of the call ``what`` becomes."""
    return LedgerUnavailable(f"redis {what}: {type(exc).__name__}: {exc}")


@contextlib.asynccontextmanager
async def redis_call(what: str, timeout_s: float) -> AsyncIterator[None]:
    """Bound a Redis call by ``timeout_s`` and translate its failures to LedgerUnavailable."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except REDIS_FAILURES as exc:
        raise unavailable(what, exc) from exc
