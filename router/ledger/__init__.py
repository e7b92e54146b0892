"""The ledger: everything that knows Redis (DESIGN.md §5, §7.7).

Only this package spells a Redis key or imports the Redis client. The rest of the router talks
to it through :class:`Ledger` (chains, generations, lineage records), :class:`KeyStore` (API
keys), :class:`RunStore` (runs, snapshots, the replica registry) and :class:`Turns` (leases,
reset marks, the serial turn of eval runs).
"""

from router.ledger.chain import Advance, ChainHead
from router.ledger.core import Ledger
from router.ledger.errors import (
    LedgerError,
    LedgerUnavailable,
    SpoolUnavailable,
    UnknownReplica,
)
from router.ledger.writer import LedgerConfig

__all__ = [
    "Advance",
    "ChainHead",
    "Ledger",
    "LedgerConfig",
    "LedgerError",
    "LedgerUnavailable",
    "SpoolUnavailable",
    "UnknownReplica",
]
