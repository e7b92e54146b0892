"""Leases, reset marks and the serial turn of an eval run: the Redis side (DESIGN.md §5).

Every key here carries its replica's hash tag, so each script touches one slot:

- ``kvl:{replica:ID}:lease``: the run holding the replica (``SET NX PX``, renewed per request);
- ``kvl:{replica:ID}:resetting``: a verified reset is under way: its owner (a proxy instance)
  with a short expiry that the owner's heartbeat renews (other proxies' monitors skip the
  replica, so the counters going back to zero do not read as a restart); next to it
  ``kvl:{replica:ID}:reset``, the reset's intent (owner, run, reason, started), which lives
  until the reset ends: an intent without its heartbeat is a reset whose owner died, which any
  proxy's monitor takes over and finishes (``router.eval.recovery``);
- ``kvl:{replica:ID}:queue`` (list of tickets, in arrival order), ``:waiters`` (ticket ->
  deadline in ms, refreshed while its request waits; a dead waiter's ticket is dropped),
  ``:turn`` (the fence token of the request being served, with expiry, renewed while it runs),
  ``:fence`` (the token counter) and ``:run`` (the run and the replica's request counter after
  the run's last request, for continuity).

The fenced chain step (``router.ledger.scripts``) checks that the caller's token still holds the
turn, so a holder whose turn expired (a stalled proxy) cannot pass its step off as ordered.
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
from redis.typing import EncodableT

from router.ledger.errors import LedgerUnavailable, redis_call
from router.ledger.schema import PREFIX, lease_key, replica_key, text

LEASE_LOCK = PREFIX + "lease-lock"


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

# KEYS resetting, intent. ARGV owner, ttl ms, run, reason, started. A reset begins unless one is
# under way (returns its owner instead) or one left unfinished awaits recovery ('!' and why).
BEGIN_RESET_LUA = """
local owner = redis.call('GET', KEYS[1])
if owner then return owner end
if redis.call('EXISTS', KEYS[2]) == 1 then
  local failed = redis.call('HGET', KEYS[2], 'failed')
  if failed then return '!' .. failed end
  return '!its proxy ' .. (redis.call('HGET', KEYS[2], 'owner') or '?') .. ' died'
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'owner', ARGV[1], 'run', ARGV[3], 'reason', ARGV[4],
           'started', ARGV[5])
return ''
"""

# KEYS resetting, intent. ARGV owner, ttl ms. Take over a reset whose owner's heartbeat is gone.
TAKE_OVER_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 0 then return {} end
local dead = redis.call('HGET', KEYS[2], 'owner') or '?'
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'owner', ARGV[1], 'dead_owner', dead)
return redis.call('HGETALL', KEYS[2])
"""

# KEYS resetting, intent. ARGV owner: the reset ended; only its owner may say so.
END_RESET_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[2], 'owner') == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS resetting, intent. ARGV owner, why: the reset failed after the model was touched; its
# intent stays (without its run, which the owner fails) for the monitors' recovery.
LEAVE_RESET_LUA = """
if redis.call('HGET', KEYS[2], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[2], 'failed', ARGV[2], 'run', '')
end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS[1] a key. ARGV value: delete it only while it still holds value.
FREE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
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
        self._begin_reset = client.register_script(BEGIN_RESET_LUA)
        self._take_over = client.register_script(TAKE_OVER_LUA)
        self._end_reset = client.register_script(END_RESET_LUA)
        self._leave_reset = client.register_script(LEAVE_RESET_LUA)

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
            pipe.exists(replica_key(replica, "resetting"))
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

    def _reset_keys(self, replica: str) -> list[str]:
        return [replica_key(replica, "resetting"), replica_key(replica, "reset")]

    async def begin_reset(self, replica: str, owner: str, ttl_ms: int, **intent: str) -> str:
        """Mark a reset under way; '' when marked, else the owner of the reset under way, or
        '!' and why an earlier reset awaits recovery."""
        args: list[EncodableT] = [
            owner,
            ttl_ms,
            intent.get("run", ""),
            intent.get("reason", ""),
            intent["started"],
        ]
        async with redis_call("begin reset", self._timeout):
            return text(await self._begin_reset(keys=self._reset_keys(replica), args=args))

    async def reset_heartbeat(self, replica: str, owner: str, ttl_ms: int) -> bool:
        """Renew the reset's mark; False when this owner no longer holds it."""
        async with redis_call("reset heartbeat", self._timeout):
            keys = [replica_key(replica, "resetting")]
            return bool(await self._renew(keys=keys, args=[owner, ttl_ms]))

    async def end_reset(self, replica: str, owner: str) -> None:
        async with redis_call("end reset", self._timeout):
            await self._end_reset(keys=self._reset_keys(replica), args=[owner])

    async def leave_reset(self, replica: str, owner: str, failed: str) -> None:
        """The reset failed with the model unloaded or reloading: drop the mark, keep the intent
        (saying why) so that a monitor brings the model back and raises the generation."""
        async with redis_call("leave reset", self._timeout):
            await self._leave_reset(keys=self._reset_keys(replica), args=[owner, failed])

    async def orphaned_resets(self, replicas: Iterable[str]) -> list[str]:
        """Replicas whose reset intent has outlived its owner's heartbeat."""
        ids = list(replicas)
        pipe = self._client.pipeline(transaction=False)
        for replica in ids:
            pipe.exists(*self._reset_keys(replica))
            pipe.exists(replica_key(replica, "resetting"))
        async with redis_call("read resets", self._timeout):
            replies = await pipe.execute()
        # EXISTS of both keys counts 1 when only the intent (or only the mark) is left.
        return [r for i, r in enumerate(ids) if replies[2 * i] == 1 and not replies[2 * i + 1]]

    async def take_over_reset(self, replica: str, owner: str, ttl_ms: int) -> dict[str, str]:
        """The orphaned reset's intent, now this owner's; {} when there is none to take."""
        async with redis_call("take over reset", self._timeout):
            raw = await self._take_over(keys=self._reset_keys(replica), args=[owner, ttl_ms])
        values = [text(v) for v in raw or []]
        return dict(zip(values[::2], values[1::2], strict=True))

    # Continuity -----------------------------------------------------------------------------

    async def set_run_counter(self, replica: str, run: str, count: int) -> None:
        async with redis_call("set run counter", self._timeout):
            await self._client.hset(
                replica_key(replica, "run"), mapping={"run": run, "count": count}
            )

    # Turns ----------------------------------------------------------------------------------

    def _queue_keys(self, replica: str) -> list[str]:
        return [replica_key(replica, "queue"), replica_key(replica, "waiters")]

    async def enqueue(self, replica: str, waiter_ttl_ms: int) -> str:
        keys = [*self._queue_keys(replica), replica_key(replica, "tickets")]
        async with redis_call("enqueue", self._timeout):
            return text(await self._enqueue(keys=keys, args=[waiter_ttl_ms]))

    async def try_acquire(
        self, replica: str, ticket: str, waiter_ttl_ms: int, turn_ttl_ms: int
    ) -> Turn | None:
        """The turn if it is this ticket's; None to wait; TurnLost if the ticket was dropped."""
        keys = [
            *self._queue_keys(replica),
            replica_key(replica, "turn"),
            replica_key(replica, "fence"),
            replica_key(replica, "run"),
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
            keys = [replica_key(turn.replica, "turn")]
            return bool(await self._renew(keys=keys, args=[turn.token, ttl_ms]))

    async def release(self, replica: str, ticket: str, token: str = "") -> None:
        keys = [*self._queue_keys(replica), replica_key(replica, "turn")]
        async with redis_call("release turn", self._timeout):
            await self._release(keys=keys, args=[ticket, token])
