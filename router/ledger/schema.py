"""Every key the ledger writes in Redis, and how its values read back (DESIGN.md §7.7).

Only this module spells a key. Keys updated together share a hash tag, so the layout works on
Redis Cluster: a replica's chain step touches only ``{replica:ID}`` keys (its chain hash, its
step keys and its lineage stream ``kvl:{replica:ID}:lineage``, the record of truth, written in
the same Lua call as the step: see ``router.ledger.scripts``).

Lineage stream entries have two fields: ``id``, the request id (so ``XRANGE`` output can be
grepped), and ``r``, the record as JSON. The step also writes ``kvl:{replica:ID}:req:REQ``, the
record by request id (with expiry). ``kvl:{run:ID}:lineage`` (an eval run's records) is an
index written behind the response; readers drop its duplicates. ``kvl:generations`` entries
have the fields replica, generation, reason, engine_digest, known, at (and a reset's figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from redis.typing import EncodableT, FieldT

from router.ledger.chain import Advance, ChainHead

PREFIX = "kvl:"
KEYS_HASH = PREFIX + "keys"
KEY_NAMES = PREFIX + "key-names"  # name -> sha256, so a name is claimed atomically (HSETNX)
GENERATIONS = PREFIX + "generations"
# replica id -> {model, reuse}: every proxy registers its replicas (readers find their streams)
REPLICAS = PREFIX + "replicas"
# The ledger's epoch (created once, never changed) and every epoch created: see ``epoch``.
EPOCH = PREFIX + "epoch"
EPOCHS = PREFIX + "epochs"
# Generation changes are rare (resets, restarts); this keeps years of them.
GENERATIONS_MAXLEN = 100_000
HEAD_FIELDS = ("generation", "seq", "state", "engine_digest", "known")


def cache_key(replica: str) -> str:
    return f"{PREFIX}{{replica:{replica}}}:cache"


def lease_key(replica: str) -> str:
    return f"{PREFIX}{{replica:{replica}}}:lease"


def replica_key(replica: str, name: str) -> str:
    """A key in the replica's hash tag (``lease``, ``turn``, ``queue``, ...)."""
    return f"{PREFIX}{{replica:{replica}}}:{name}"


def step_key(replica: str, request_id: str) -> str:
    """The remembered answer of one chain step, so a retry cannot step or write twice."""
    return f"{PREFIX}{{replica:{replica}}}:step:{request_id}"


def step_keys(replica: str, request_id: str) -> list[str]:
    """The keys one chain step touches (see ``scripts``): chain, step key, stream, record."""
    return [
        cache_key(replica),
        step_key(replica, request_id),
        replica_lineage_key(replica),
        request_key(replica, request_id),
    ]


def replica_lineage_key(replica: str) -> str:
    """The replica's lineage stream: every record of a request it served, in chain order."""
    return f"{PREFIX}{{replica:{replica}}}:lineage"


def run_lineage_key(run: str) -> str:
    return f"{PREFIX}{{run:{run}}}:lineage"


def request_key(replica: str, request_id: str) -> str:
    """One record by request id, in its replica's hash tag (written by the chain step)."""
    return f"{PREFIX}{{replica:{replica}}}:req:{request_id}"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def head_from(replica: str, values: Sequence[Any]) -> ChainHead | None:
    """A head from ``HMGET`` of :data:`HEAD_FIELDS` (or a script's answer), None if absent."""
    generation, seq, state, engine_digest, known = values[:5]
    if generation is None or state is None:
        return None
    return ChainHead(
        replica,
        int(generation),
        int(seq),
        text(state),
        text(engine_digest or ""),
        known=known is None or text(known) != "0",
    )


def advance_from(replica: str, raw: Any) -> Advance | None:
    """A step script's answer (``STATUS GEN SEQ BEFORE AFTER KNOWN``); None: no chain."""
    parts = text(raw).split(" ")
    if parts[0] == "nochain":
        return None
    status, generation, seq, before, after, known = parts
    stale = status == "stale"
    return Advance(  # replica, generation, seq, state_before, state_after, known, stale, unordered
        replica,
        int(generation),
        None if stale else int(seq),
        None if stale else before,
        None if stale else after,
        known == "1",
        stale,
        status == "unordered",
    )


def stream_fields(request_id: str, data: bytes) -> dict[FieldT, EncodableT]:
    return {"id": request_id, "r": data}


def field(fields: Mapping[Any, Any], name: str) -> Any:
    """A stream entry's field whether or not the client decodes responses."""
    value = fields.get(name)
    return fields.get(name.encode()) if value is None else value


def entry_record(fields: Mapping[Any, Any]) -> dict[str, Any] | None:
    raw = field(fields, "r")
    if raw is None:
        return None
    record: dict[str, Any] = orjson.loads(raw)
    return record


def generation_fields(
    replica: str,
    generation: int,
    reason: str,
    engine_digest: str,
    at: str,
    details: Mapping[str, str] | None = None,
) -> dict[FieldT, EncodableT]:
    """A ``kvl:generations`` entry; ``details`` adds fields (a reset's duration, its run)."""
    fields: dict[FieldT, EncodableT] = {
        "replica": replica,
        "generation": generation,
        "reason": reason,
        "engine_digest": engine_digest,
        "at": at,
    }
    fields.update(details or {})
    return fields
