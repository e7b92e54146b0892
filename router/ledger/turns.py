"""Leases, reset marks and the serial turn of an eval run: the Redis side (DESIGN.md §5).

Every key here carries its replica's hash tag, so each script touches one slot:

- ``kvl:{replica:ID}:lease``: the run holding the replica (``SET NX PX``, renewed per request);
- ``kvl:{replica:ID}:resetting``: a verified reset is under way (other proxies' monitors skip
  the replica, so the counters going back to zero do not read as a restart);
- ``kvl:{replica:ID}:queue`` (list of tickets, in arrival order), ``:waiters`` (ticket ->
  deadline in ms, refreshed while its request waits; a dead waiter's ticket is dropped),
  ``:turn`` (the fence token of the request being served, with expiry, renewed while it runs),
  ``:fence`` (the token counter) and ``:run`` (the run and the replica's request counter after
  the run's last request, for continuity).

The fenced chain step advances the chain only while the caller's token holds the turn, so a
holder whose turn expired (a stalled proxy) cannot advance a chain someone else now serves.
One global key, ``kvl:lease-lock``, serialises lease decisions, which are rare, so the number
of replicas left to production is checked against every proxy's leases at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from router.ledger.chain import Advance
from router.ledger.errors import LedgerUnavailable, redis_call
from router.ledger.schema import PREFIX, advance_from, cache_key, lease_key, text

LEASE_LOCK = PREFIX + "lease-lock"


def _key(replica: str, name: str) -> str:
    return f"{PREFIX}{{replica:{replica}}}:{name}"


# KEYS queue, waiters, tickets. ARGV waiter ttl ms. Returns the new ticket.
ENQUEUE_LUA = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ticket = redis.call('INCR', KEYS[3])
redis.call('RPUSH', KEYS[1], ticket)
redis.call('HSET', KEYS[2], ticket, ms + tonumber(ARGV[1]))
return ticket
"""

# KEYS queue, waiters, turn, fence, run. ARGV ticket, waiter ttl ms, turn ttl ms.
# Drops dead heads; when the ticket is at the head and nobody holds the turn, takes it.
# Returns {token, run, count} on success, {'wait'} or {'lost'} (the ticket was dropped).
ACQUIRE_LUA = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if not redis.call('HGET', KEYS[2], ARGV[1]) then return {'lost'} end
redis.call('HSET', KEYS[2], ARGV[1], ms + tonumber(ARGV[2]))
while true do
  local head = redis.call('LINDEX', KEYS[1], 0)
  if not head then return {'lost'} end
  if head == ARGV[1] then break end
  local deadline = tonumber(redis.call('HGET', KEYS[2], head) or '0')
  if deadline >= ms then return {'wait'} end
  redis.call('LPOP', KEYS[1])
  redis.call('HDEL', KEYS[2], head)
end
if redis.call('EXISTS', KEYS[3]) == 1 then return {'wait'} end
local token = redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[3], token, 'PX', ARGV[3])
local run = redis.call('HMGET', KEYS[5], 'run', 'count')
return {tostring(token), run[1] or '', run[2] or '-1'}
"""

# KEYS queue, waiters, turn. ARGV ticket, token (or ''). Leaves the queue and frees the turn.
RELEASE_LUA = """
redis.call('LREM', KEYS[1], 1, ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
return 1
"""

# KEYS[1] a key. ARGV value, ttl ms: extend its expiry only while it still holds value.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] a key. ARGV value: delete it only while it still holds value.
FREE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS cache, turn, run. ARGV generation, digest, token, run id, counter after the request.
# The chain step of an eval request: only while the token holds the turn.
FENCED_ADVANCE_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 'fenced' end
local cur = redis.call('HMGET', KEYS[1], 'generation', 'seq', 'state')
if not cur[1] then return 'unknown' end
redis.call('HSET', KEYS[3], 'run', ARGV[4], 'count', ARGV[5])
if cur[1] ~= ARGV[1] then
  return table.concat({'stale', cur[1], cur[2], cur[3], cur[3]}, ' ')
end
local after = redis.sha1hex(cur[3] .. '|' .. ARGV[2])
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('HSET', KEYS[1], 'state', after)
return table.concat({'ok', cur[1], tostring(seq), cur[3], after}, ' ')
"""


@dataclass(frozen=True, slots=True)
class Turn:
    """A request's turn on a leased replica: its fence token and the run's last counter."""

    replica: str
    ticket: str
    token: str
    run: str
    count: int  # the replica's request counter after the run's previous request (-1: unknown)


class TurnLost(Exception):
    """The ticket was dropped from the queue (its waiter looked dead); enqueue again."""


class Turns:
    """Leases, reset marks, the turn queue and the fenced chain step (see module docstring)."""

    def __init__(self, client: aioredis.Redis, timeout_s: float = 2.0) -> None:
        self._client = client
        self._timeout = timeout_s
        self._enqueue = client.register_script(ENQUEUE_LUA)
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._free = client.register_script(FREE_LUA)
        self._fenced = client.register_script(FENCED_ADVANCE_LUA)

    # Leases ----------------------------------------------------------------------------------

    async def take_lease(self, replica: str, run: str, ttl_ms: int) -> str | None:
        """None when the lease was taken; else the run that holds it."""
        async with redis_call("take lease", self._timeout):
            if await self._client.set(lease_key(replica), run, nx=True, px=ttl_ms):
                return None
            holder = await self._client.get(lease_key(replica))
        return text(holder) if holder is not None else "(just released)"

    async def renew_lease(self, replica: str, run: str, ttl_ms: int) -> bool:
        async with redis_call("renew lease", self._timeout):
            return bool(await self._renew(keys=[lease_key(replica)], args=[run, ttl_ms]))

    async def free_lease(self, replica: str, run: str) -> bool:
        async with redis_call("free lease", self._timeout):
            return bool(await self._free(keys=[lease_key(replica)], args=[run]))

    async def marks(self, replicas: Iterable[str]) -> dict[str, tuple[str | None, bool]]:
        """Per replica: the run leasing it, and whether a verified reset is under way."""
        ids = list(replicas)
        pipe = self._client.pipeline(transaction=False)
        for replica in ids:
            pipe.get(lease_key(replica))
            pipe.exists(_key(replica, "resetting"))
        async with redis_call("read leases", self._timeout):
            replies = await pipe.execute()
        return {
            replica: (
                None if replies[2 * i] is None else text(replies[2 * i]),
                bool(replies[2 * i + 1]),
            )
            for i, replica in enumerate(ids)
        }

    @contextlib.asynccontextmanager
    async def lease_lock(self, wait_s: float = 10.0) -> AsyncIterator[None]:
        """Serialise lease decisions across proxies (held for milliseconds, expires in 10 s)."""
        token = secrets.token_hex(8)
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    async with redis_call("lease lock", self._timeout):
                        if await self._client.set(LEASE_LOCK, token, nx=True, px=10_000):
                            break
                    await asyncio.sleep(0.02)
        except TimeoutError as exc:
            raise LedgerUnavailable(f"the lease lock stayed taken for {wait_s:g} s") from exc
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                await self._free(keys=[LEASE_LOCK], args=[token])

    async def mark_resetting(self, replica: str, ttl_ms: int) -> None:
        async with redis_call("mark reset", self._timeout):
            await self._client.set(_key(replica, "resetting"), "1", px=ttl_ms)

    async def clear_resetting(self, replica: str) -> None:
        async with redis_call("clear reset mark", self._timeout):
            await self._client.delete(_key(replica, "resetting"))

    # Continuity -----------------------------------------------------------------------------

    async def set_run_counter(self, replica: str, run: str, count: int) -> None:
        async with redis_call("set run counter", self._timeout):
            await self._client.hset(_key(replica, "run"), mapping={"run": run, "count": count})

    # Turns ----------------------------------------------------------------------------------

    def _queue_keys(self, replica: str) -> list[str]:
        return [_key(replica, "queue"), _key(replica, "waiters")]

    async def enqueue(self, replica: str, waiter_ttl_ms: int) -> str:
        keys = [*self._queue_keys(replica), _key(replica, "tickets")]
        async with redis_call("enqueue", self._timeout):
            return text(await self._enqueue(keys=keys, args=[waiter_ttl_ms]))

    async def try_acquire(
        self, replica: str, ticket: str, waiter_ttl_ms: int, turn_ttl_ms: int
    ) -> Turn | None:
        """The turn if it is this ticket's; None to wait; TurnLost if the ticket was dropped."""
        keys = [
            *self._queue_keys(replica),
            _key(replica, "turn"),
            _key(replica, "fence"),
            _key(replica, "run"),
        ]
        async with redis_call("acquire turn", self._timeout):
            raw = await self._acquire(keys=keys, args=[ticket, waiter_ttl_ms, turn_ttl_ms])
        first = text(raw[0])
        if first == "wait":
            return None
        if first == "lost":
            raise TurnLost(ticket)
        return Turn(replica, ticket, first, text(raw[1]), int(text(raw[2])))

    async def renew_turn(self, turn: Turn, ttl_ms: int) -> bool:
        async with redis_call("renew turn", self._timeout):
            keys = [_key(turn.replica, "turn")]
            return bool(await self._renew(keys=keys, args=[turn.token, ttl_ms]))

    async def release(self, replica: str, ticket: str, token: str = "") -> None:
        keys = [*self._queue_keys(replica), _key(replica, "turn")]
        async with redis_call("release turn", self._timeout):
            await self._release(keys=keys, args=[ticket, token])

    async def fenced_advance(
        self, turn: Turn, generation: int, digest: str, run: str, count: int
    ) -> Advance | None:
        """The chain step under the turn; None when the turn was lost (fenced out)."""
        keys = [cache_key(turn.replica), _key(turn.replica, "turn"), _key(turn.replica, "run")]
        async with redis_call("fenced advance", self._timeout):
            raw = await self._fenced(keys=keys, args=[generation, digest, turn.token, run, count])
        if text(raw) == "fenced":
            return None
        return advance_from(turn.replica, raw)
