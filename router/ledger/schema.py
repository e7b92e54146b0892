"""Everything the ledger writes to Redis: key names, stream lengths and fields, Lua scripts.

Only this module spells a key (DESIGN.md §7.7). Keys updated together share a hash tag, so the
layout works on Redis Cluster: a replica's chain step touches only ``{replica:ID}`` keys, and
the lineage streams, which live elsewhere, are written by separate commands.

Lineage stream entries (``kvl:lineage`` and ``kvl:{run:ID}:lineage``) have two fields:
``id``, the request id (so ``XRANGE`` output can be grepped), and ``r``, the record as orjson.
``kvl:req:ID`` holds the same orjson bytes. ``kvl:generations`` entries have the fields
replica, generation, reason, engine_digest and at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.typing import EncodableT, FieldT

from router.ledger.chain import Advance, ChainHead

PREFIX = "kvl:"
KEYS_HASH = PREFIX + "keys"
KEY_NAMES = PREFIX + "key-names"  # name -> sha256, so a name is claimed atomically (HSETNX)
LINEAGE = PREFIX + "lineage"
GENERATIONS = PREFIX + "generations"
# Generation changes are rare (resets, restarts); this keeps years of them.
GENERATIONS_MAXLEN = 100_000
HEAD_FIELDS = ("generation", "seq", "state", "engine_digest")


def cache_key(replica: str) -> str:
    return f"{PREFIX}{{replica:{replica}}}:cache"


def lease_key(replica: str) -> str:
    return f"{PREFIX}{{replica:{replica}}}:lease"


def step_key(replica: str, request_id: str) -> str:
    """The remembered result of one late (spooled) chain step, so a retry cannot step twice."""
    return f"{PREFIX}{{replica:{replica}}}:step:{request_id}"


def run_lineage_key(run: str) -> str:
    return f"{PREFIX}{{run:{run}}}:lineage"


def request_key(request_id: str) -> str:
    return f"{PREFIX}req:{request_id}"


# KEYS[1] cache hash. ARGV: engine digest, its genesis, now. A new hash starts at generation 1;
# a different engine digest is a new generation. Returns generation, seq, state, digest, reason
# (reason "" when nothing changed).
ENSURE_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'state', 'engine_digest')
if cur[1] and cur[4] == ARGV[1] then
  return {cur[1], cur[2], cur[3], cur[4], ''}
end
local reason = 'first seen'
if cur[1] then reason = 'engine changed' end
local gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
redis.call('HSET', KEYS[1], 'seq', 0, 'state', ARGV[2], 'engine_digest', ARGV[1],
           'since', ARGV[3], 'reason', reason)
return {tostring(gen), '0', ARGV[2], ARGV[1], reason}
"""

# KEYS[1] cache hash. ARGV: engine digest, its genesis, now, reason. Returns the new generation.
NEW_GENERATION_LUA = """
local gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
redis.call('HSET', KEYS[1], 'seq', 0, 'state', ARGV[2], 'engine_digest', ARGV[1],
           'since', ARGV[3], 'reason', ARGV[4])
return tostring(gen)
"""

# KEYS[1] cache hash, KEYS[2] (optional) step key. ARGV: generation, request digest, step key
# TTL. Returns "ok|stale GEN SEQ BEFORE AFTER", or "unknown" when the replica has no chain.
# With a step key the first answer is remembered and repeated, which makes a retried step
# (reply lost, proxy crashed mid-drain) idempotent.
ADVANCE_LUA = """
if KEYS[2] then
  local done = redis.call('GET', KEYS[2])
  if done then return done end
end
local cur = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'state')
if not cur[1] then return 'unknown' end
local out
if cur[1] ~= ARGV[1] then
  out = table.concat({'stale', cur[1], cur[2], cur[3], cur[3]}, ' ')
else
  local after = redis.sha1hex(cur[3] .. '|' .. ARGV[2])
  local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
  redis.call('HSET', KEYS[1], 'state', after)
  out = table.concat({'ok', cur[1], tostring(seq), cur[3], after}, ' ')
end
if KEYS[2] then redis.call('SET', KEYS[2], out, 'EX', ARGV[3]) end
return out
"""


class Scripts:
    """The ledger's Lua scripts, bound to one client (EVALSHA, loaded again on NOSCRIPT)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.ensure: AsyncScript = client.register_script(ENSURE_LUA)
        self.new_generation: AsyncScript = client.register_script(NEW_GENERATION_LUA)
        self.advance: AsyncScript = client.register_script(ADVANCE_LUA)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def head_from(replica: str, values: Sequence[Any]) -> ChainHead | None:
    """A head from ``HMGET`` of :data:`HEAD_FIELDS` (or the ensure script), None if absent."""
    generation, seq, state, engine_digest = values[:4]
    if generation is None or state is None:
        return None
    return ChainHead(replica, int(generation), int(seq), text(state), text(engine_digest or ""))


def advance_from(replica: str, raw: Any) -> Advance | None:
    """The advance script's answer, None for a replica that has no chain."""
    parts = text(raw).split(" ")
    if parts[0] == "unknown":
        return None
    status, generation, seq, before, after = parts
    return Advance(replica, int(generation), int(seq), before, after, stale=status == "stale")


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
