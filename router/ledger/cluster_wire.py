"""The chain step's wire on a Redis Cluster: one :class:`~router.ledger.wire.Wire` per master,
and the slot map that says which.

A step's keys share one hash tag (``kvl:{replica:ID}:...``), so one slot and one master: the
step is sent there, still one round trip. The slot map comes from ``CLUSTER SLOTS`` (asked of
any node that answers, the startup nodes first). Redirections and faults, within the step's
one deadline:

- ``MOVED slot host:port``: the slot lives elsewhere now (a failover, a resharding). The map
  says so at once and is read again in full; the step is resent to the new owner.
- ``ASK slot host:port``: the slot is migrating and this key is already on the target:
  ``ASKING`` then the script, on one connection to the target (the script's text, by ``EVAL``:
  ``ASKING`` holds for one command only, so no ``NOSCRIPT`` round). Followed once per attempt.
  A chain step creates keys (its step key, its record's key), and a migrating slot refuses a
  command on keys some of which are absent (``TRYAGAIN``, on the target too): in practice a
  step waits, retried as below, until the migration of its slot ends (then ``MOVED``).
- ``TRYAGAIN`` (a multi-key command during a migration), ``CLUSTERDOWN`` (a failover under
  way), a connection refused or lost, or a node silent past its share of the deadline: the map
  is read again and the step retried after a short pause, until the deadline, which then raises
  as a single node's wire does (the ledger spools the step; the writer sends it later through
  redis-py's cluster client, which follows the same redirections).

The chain step is idempotent (its step key), so a resend after a lost reply runs it once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import ResponseError

from router.ledger.wire import Arg, Wire

SLOTS = 16384
RETRY_PAUSE_S = 0.05  # first pause before a retry; doubles up to RETRY_PAUSE_MAX_S
RETRY_PAUSE_MAX_S = 0.4

Node = tuple[str, int]


class ClusterWire:
    """Scripts sent to the master that owns their keys' slot, one connection per master."""

    def __init__(
        self,
        nodes: Sequence[Node],
        *,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 0.5,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster wire needs at least one node")
        self._startup = list(nodes)
        self._username, self._password = username, password
        self.connect_timeout_s = connect_timeout_s
        self._owner: list[Node | None] = [None] * SLOTS
        self._replicated: list[bool] = [False] * SLOTS  # the map lists a replica for the slot
        self._wires: dict[Node, Wire] = {}
        self._loading: asyncio.Task[None] | None = None
        self.redirections = 0  # MOVED and ASK followed (for tests and stats)
        self.refreshes = 0

    @classmethod
    def like(cls, client: object) -> ClusterWire | None:
        """A cluster wire to the cluster of ``client`` (redis-py's ``RedisCluster``); None for
        what the wire does not speak (TLS)."""
        kwargs: dict[str, Any] = dict(getattr(client, "connection_kwargs", None) or {})
        if kwargs.get("connection_class", Connection) is not Connection:
            return None
        nodes = getattr(client, "startup_nodes", None) or []
        found = [(str(n.host), int(n.port)) for n in nodes]
        if not found:
            return None
        return cls(
            found,
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            connect_timeout_s=float(kwargs.get("socket_connect_timeout") or 0.5),
        )

    def owner(self, key: Arg) -> Node | None:
        """The master that owns ``key``'s slot, as far as the map knows."""
        return self._owner[_slot(key)]

    def replicated(self, key: Arg) -> bool:
        """True when the map lists a replica of ``key``'s master (a ``WAIT`` can succeed)."""
        return self._replicated[_slot(key)]

    async def refresh(self) -> None:
        """Read the slot map again (one read at a time, however many callers ask)."""
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._load())
        await asyncio.shield(self._loading)

    async def call(self, *args: Arg, key: Arg, timeout_s: float | None = None) -> Any:
        """One command for the master that owns ``key``, redirected as a script is."""
        return await self._routed(key, timeout_s, lambda wire, t: wire.call(*args, timeout_s=t))

    async def script(
        self,
        script: AsyncScript,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        timeout_s: float | None = None,
    ) -> Any:
        """Run ``script`` on the master that owns its keys' slot (see the module docstring)."""
        return await self._routed(
            keys[0],
            timeout_s,
            lambda wire, t: wire.script(script, keys, args, t),
            ask=lambda wire, t: _asking(wire, ["EVAL", script.script, len(keys), *keys, *args], t),
        )

    async def script_wait(
        self,
        script: AsyncScript,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        timeout_s: float,
        wait_ms: int,
    ) -> tuple[Any, int]:
        """:meth:`script`, then ``WAIT 1 wait_ms`` on the same connection (see
        ``Wire.script_wait``): the reply and how many replicas acknowledged it."""
        reply: tuple[Any, int] = await self._routed(
            keys[0],
            timeout_s,
            lambda wire, t: wire.script_wait(script, keys, args, t, wait_ms),
        )
        return reply

    def close(self) -> None:
        for wire in self._wires.values():
            wire.close()
        self._wires.clear()
        if self._loading is not None:
            self._loading.cancel()

    async def _routed(self, key: Arg, timeout_s: float | None, send: Any, ask: Any = None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        slot = _slot(key)
        pause = RETRY_PAUSE_S
        while True:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise TimeoutError(f"no reply within {timeout_s:g} s (cluster slot {slot})")
            try:
                node = self._owner[slot]
                if node is None:
                    async with asyncio.timeout(left):
                        await self.refresh()
                    node = self._owner[slot]
                    if node is None:
                        raise ConnectionError(f"no master serves slot {slot}")
                    left = None if deadline is None else deadline - loop.time()
                try:
                    return await send(self._wire(node), left)
                except ResponseError as exc:
                    word, _, rest = str(exc).partition(" ")
                    if word != "ASK" or ask is None:
                        raise
                self.redirections += 1  # ASK: once, to the target, then from the top
                left = None if deadline is None else max(0.001, deadline - loop.time())
                return await ask(self._wire(_node(rest)), left)
            except ResponseError as exc:
                word, _, rest = str(exc).partition(" ")
                if word == "MOVED":
                    self.redirections += 1
                    self._owner[slot] = _node(rest)
                    self._refresh_soon()
                    continue
                if word not in ("TRYAGAIN", "CLUSTERDOWN"):
                    raise
                failure: BaseException = exc
            except (OSError, TimeoutError) as exc:  # ConnectionError is an OSError
                failure = exc
                self._owner[slot] = None  # ask the cluster again who serves it
            # A retry, if the deadline leaves time for one after a pause.
            if deadline is not None and loop.time() + pause >= deadline:
                raise failure
            await asyncio.sleep(pause * (0.5 + random.random() / 2))
            pause = min(pause * 2, RETRY_PAUSE_MAX_S)

    def _wire(self, node: Node) -> Wire:
        wire = self._wires.get(node)
        if wire is None:
            wire = Wire(
                node[0],
                node[1],
                username=self._username,
                password=self._password,
                connect_timeout_s=self.connect_timeout_s,
            )
            self._wires[node] = wire
        return wire

    def _refresh_soon(self) -> None:
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._load())
            self._loading.add_done_callback(_quiet)

    async def _load(self) -> None:
        """The slot map from ``CLUSTER SLOTS`` of the first node that answers: the masters
        the map knows, then the startup nodes."""
        self.refreshes += 1
        known = {n for n in self._owner if n is not None}
        candidates = list(dict.fromkeys([*known, *self._startup]))
        random.shuffle(candidates)
        failure: BaseException | None = None
        for node in candidates:
            try:
                reply = await self._wire(node).call(
                    "CLUSTER", "SLOTS", timeout_s=max(self.connect_timeout_s, 0.5)
                )
            except (OSError, TimeoutError, ResponseError) as exc:
                failure = exc
                continue
            owner: list[Node | None] = [None] * SLOTS
            replicated = [False] * SLOTS
            for entry in reply:
                low, high, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                if not host:  # the node we asked, which knows no address for itself
                    host = node[0]
                owner[low : high + 1] = [(host, int(master[1]))] * (high - low + 1)
                replicated[low : high + 1] = [len(entry) > 3] * (high - low + 1)
            # Once listed, a slot's replica is expected (see ``core.Durability``): a master
            # promoted without one answers its WAITs late, durable: false, not silently none.
            self._owner = owner
            self._replicated = [a or b for a, b in zip(self._replicated, replicated, strict=True)]
            return
        raise ConnectionError(f"no cluster node answered CLUSTER SLOTS: {failure}")


async def _asking(wire: Wire, command: list[Arg], timeout_s: float | None) -> Any:
    """``ASKING`` and the command, pipelined on one connection (ASKING holds for one command)."""
    asking, reply = await wire.pipeline([["ASKING"], command], timeout_s)
    for value in (asking, reply):
        if isinstance(value, BaseException):
            raise value
    return reply


def _slot(key: Arg) -> int:
    if isinstance(key, str):
        key = key.encode()
    elif not isinstance(key, bytes):
        key = str(key).encode()
    return int(key_slot(key))


def _node(address: str) -> Node:
    """``host:port`` of a redirection (its slot number stripped off)."""
    address = address.split(" ")[-1]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _quiet(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # a failed background read: the next step reads the map again
