"""Reset notices: a verified reset tells every proxy at once, and waits for their answers.

Before a reset touches a replica, every proxy instance must have stopped admitting to it. Each
proxy's monitor learns the reset's mark within one monitor interval, which used to be the wait;
instead the reset publishes a notice on the channel ``kvl:resets``, every proxy sets the
replica aside at once and acknowledges in ``kvl:{replica:ID}:acks`` (proxy -> the mark it saw),
and the reset waits only until every proxy seen alive lately (``kvl:proxies``: proxy -> when
its monitor last ran, epoch ms) has acknowledged, or one monitor interval, whichever is first.

``kvl:proxies`` entries expire: each monitor tick refreshes its own entry and removes those not
refreshed within ``expire_s`` (three monitor intervals), so a proxy that died (or never got
past its start) leaves the registry within seconds, and nothing waits on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import structlog

from router.ledger.connect import connect
from router.ledger.errors import REDIS_FAILURES, redis_call
from router.ledger.schema import PREFIX, replica_key, text

CHANNEL = PREFIX + "resets"
PROXIES = PREFIX + "proxies"
OnNotice = Callable[[str, str], Awaitable[None]]
_log = structlog.get_logger("kvledger.notices")
# KEYS[1] proxies. ARGV: proxy, now ms, oldest time still alive (ms).
_ALIVE_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) < tonumber(ARGV[3]) then redis.call('HDEL', KEYS[1], all[i]) end
end
return 1
"""


class Notices:
    def __init__(self, client: aioredis.Redis, timeout_s: float = 2.0) -> None:
        self._client = client
        self._timeout = timeout_s

    async def alive(self, proxy: str, expire_s: float | None = None) -> None:
        """This proxy's monitor ran now; entries older than ``expire_s`` are removed (one
        call: a script that refreshes this entry and drops the expired ones)."""
        now = int(time.time() * 1000)
        if expire_s is None:
            async with redis_call("proxy alive", self._timeout):
                await self._client.hset(PROXIES, proxy, now)
            return
        since = now - int(expire_s * 1000)
        async with redis_call("proxy alive", self._timeout):
            await self._client.eval(_ALIVE_LUA, 1, PROXIES, proxy, now, since)

    async def proxies(self) -> dict[str, int]:
        """Every entry of the registry: proxy -> when its monitor last ran (epoch ms)."""
        async with redis_call("read proxies", self._timeout):
            seen = await self._client.hgetall(PROXIES)
        return {text(p): int(at) for p, at in seen.items()}

    async def live_proxies(self, within_s: float) -> set[str]:
        """Proxies whose monitor ran within ``within_s``."""
        async with redis_call("read proxies", self._timeout):
            seen = await self._client.hgetall(PROXIES)
        since = time.time() * 1000 - within_s * 1000
        return {text(p) for p, at in seen.items() if int(at) >= since}

    async def announce(self, replica: str, mark: str) -> None:
        async with redis_call("announce reset", self._timeout):
            await self._client.publish(CHANNEL, f"{replica} {mark}")

    async def ack(self, replica: str, proxy: str, mark: str) -> None:
        async with redis_call("acknowledge reset", self._timeout):
            await self._client.hset(replica_key(replica, "acks"), proxy, mark)

    async def acked(self, replica: str, mark: str) -> set[str]:
        """Proxies that acknowledged this reset's mark."""
        async with redis_call("read acknowledgements", self._timeout):
            acks = await self._client.hgetall(replica_key(replica, "acks"))
        return {text(p) for p, m in acks.items() if text(m) == mark}


async def listen(url: str, on_notice: OnNotice, retry_s: float = 1.0) -> None:
    """Call ``on_notice(replica, mark)`` for every reset notice, reconnecting after failures;
    runs until cancelled. A notice missed while disconnected is caught by the monitor's tick."""
    while True:
        client = connect(url, timeout_s=None)
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        replica, _, mark = text(message["data"]).partition(" ")
                        await on_notice(replica, mark)
        except REDIS_FAILURES as exc:
            _log.warning("notices_reconnecting", error=str(exc))
            await asyncio.sleep(retry_s)
        finally:
            await client.aclose()
