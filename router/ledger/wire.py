"""A minimal pipelined Redis client for the request path's one Redis call: the chain step.

Why not redis-py there: per call it takes a connection from its pool, packs the command
through its encoder, arms its own read timeout and runs its retry and health-check machinery,
about a tenth of the proxy's CPU per request (py-spy under ``bench/overhead.py``). The step
needs one thing: send ``EVALSHA`` and read one reply. Every other Redis call stays on redis-py.

One connection, commands pipelined: Redis answers in order, so each command waits on a future
in a FIFO. A caller that gives up (its deadline) leaves its future cancelled in place; the
reply, when it comes, is read and dropped, so the connection stays in step. A lost connection
fails every waiting command with ConnectionError (an OSError, which the ledger counts as Redis
being away) and the next call connects again. A command's deadline is a timer on its future
(TimeoutError), not a cancellation of its caller. A command past its deadline also closes the
connection (failing the others still waiting on it): a connection that went silent (a NAT or a
failover that drops its packets) would otherwise time out every later command until the kernel
gave up on it, some fifteen minutes; the chain step is idempotent (its step key), so the
callers' retries on the next connection run each step once. The socket has ``SO_KEEPALIVE``
(probes after 10 s idle) so that an idle connection that died is found too.

A command sent on an idle connection (no reply awaited) is written at once: the request it
belongs to waits on nothing else, and a turn of the event loop would add its time to the round
trip. Under load (replies awaited), the commands
sent during one turn of the loop leave in one write, after it (many requests end in one turn).
Replies are parsed by hiredis' reader (the one redis-py uses): bulk strings as bytes, integers
as int, arrays as lists, an error reply raised as :class:`redis.exceptions.ResponseError`.
``NOSCRIPT`` (Redis restarted, its script cache empty) runs the script by ``EVAL``, which
caches it again, within what is left of the same deadline.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import socket
from collections.abc import Sequence
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

Arg = str | bytes | bytearray | memoryview | int | float


def pack(args: Sequence[Arg]) -> bytes:
    """One command in RESP (an array of bulk strings), by hiredis' C encoder, the one redis-py
    uses with hiredis: half the instructions of the same loop in Python (callgrind: 25k
    against 46k for the chain step's command). What it does not take (a bool, a bytearray, any
    other type) is converted first, as redis-py's own encoder would."""
    # (hiredis' stub types its argument as a tuple of one item: hence the ignores.)
    try:
        return cast(bytes, hiredis.pack_command(tuple(args)))  # type: ignore[arg-type]
    except TypeError:
        return cast(bytes, hiredis.pack_command(tuple(map(_plain, args))))  # type: ignore[arg-type]


def _plain(arg: Arg | object) -> str | bytes | int | float | memoryview:
    if isinstance(arg, bool):
        return int(arg)
    if isinstance(arg, str | bytes | int | float | memoryview):
        return arg
    if isinstance(arg, bytearray):
        return bytes(arg)
    return repr(arg)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.lost: Exception | None = None
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []  # commands sent in this turn of the loop, written after it
        # Commands with a deadline, earliest first (a heap of (when, n, future, timeout_s)):
        # one timer, for the earliest, instead of one per command.
        self._deadlines: list[tuple[float, int, asyncio.Future[Any], float]] = []
        self._sent = itertools.count()  # ties broken by order sent (futures do not compare)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.WriteTransport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if not self.waiting:  # a reply nobody asked for: the stream is out of step
                self.connection_lost(ConnectionError("redis sent a reply nobody asked for"))
                return
            future = self.waiting.popleft()
            if future.done():  # its caller gave up: the reply is dropped, the order kept
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("redis closed the connection")
        if self.transport is not None:
            self.transport.close()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"redis connection lost: {self.lost}"))

    def send(self, command: bytes, timeout_s: float | None = None) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        idle = not self.waiting  # nothing on its way: no later command of this turn to wait for
        self.waiting.append(future)
        if idle and self.transport is not None and self.lost is None:
            self.transport.write(command)
        else:
            if not self._out:
                self._loop.call_soon(self._flush)
            self._out.append(command)
        if timeout_s is not None:
            when = self._loop.time() + timeout_s
            heapq.heappush(self._deadlines, (when, next(self._sent), future, timeout_s))
            if when < self._timer_at:
                self._arm(when)
        return future

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(when, self._expire), when

    def _expire(self) -> None:
        """Fail every command past its deadline (its reply, when it comes, is dropped: see
        ``data_received``); then wait for the next deadline of a command still unanswered."""
        self._timer, self._timer_at = None, math.inf
        deadlines, now = self._deadlines, self._loop.time()
        # Answered commands leave the heap here, not when answered: the timer then fires about
        # once per deadline, not once per command.
        expired = 0.0
        while deadlines and (deadlines[0][0] <= now or deadlines[0][2].done()):
            _, _, future, timeout_s = heapq.heappop(deadlines)
            if not future.done():  # else answered (or failed) meanwhile
                future.set_exception(TimeoutError(f"no reply within {timeout_s:g} s"))
                expired = timeout_s
        if expired:  # the connection may have gone silent: never wait on it again
            self.connection_lost(TimeoutError(f"no reply within {expired:g} s"))
            deadlines.clear()
        if deadlines:
            self._arm(deadlines[0][0])

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and self.lost is None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))


class Wire:
    """Commands to one Redis (``host``, ``port``, ``db``, optional AUTH) on one connection."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 0.5,
    ) -> None:
        self.host, self.port, self.db = host, port, db
        self._auth = [a for a in (username, password) if a] if password else []
        self.connect_timeout_s = connect_timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    @classmethod
    def like(cls, client: aioredis.Redis) -> Wire | None:
        """A wire to the same Redis as ``client``; None for what it does not speak (TLS, a
        unix socket), where the caller keeps using ``client``."""
        pool = client.connection_pool
        if pool.connection_class is not Connection:
            return None
        kw = pool.connection_kwargs
        return cls(
            str(kw.get("host", "localhost")),
            int(kw.get("port", 6379)),
            db=int(kw.get("db", 0) or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            connect_timeout_s=float(kw.get("socket_connect_timeout") or 0.5),
        )

    async def call(self, *args: Arg, timeout_s: float | None = None) -> Any:
        """One command's reply (see the module docstring for types and errors); TimeoutError
        when it takes longer than ``timeout_s``."""
        protocol = await self._ready()
        return await protocol.send(pack(args), timeout_s)

    async def script(
        self,
        script: AsyncScript,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        timeout_s: float | None = None,
    ) -> Any:
        """Run ``script`` (redis-py's, registered on a client) by its hash, or by its text when
        Redis does not have it cached."""
        tail = [len(keys), *keys, *args]
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            return await self.call("EVALSHA", script.sha, *tail, timeout_s=timeout_s)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        if timeout_s is not None:  # one deadline for both calls
            timeout_s -= loop.time() - start
            if timeout_s <= 0:
                raise TimeoutError("no reply within the deadline (EVALSHA, then EVAL)")
        return await self.call("EVAL", script.script, *tail, timeout_s=timeout_s)

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], timeout_s: float | None = None
    ) -> list[Any]:
        """Several commands in order on the one connection (one write), their replies in
        order, an error reply or a failure as the exception in its place (not raised)."""
        protocol = await self._ready()
        futures = [protocol.send(pack(command), timeout_s) for command in commands]
        return list(await asyncio.gather(*futures, return_exceptions=True))

    async def script_wait(
        self,
        script: AsyncScript,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        timeout_s: float | None,
        wait_ms: int,
    ) -> tuple[Any, int]:
        """:meth:`script` followed by ``WAIT 1 wait_ms`` on the same connection, sent together
        (WAIT counts the replicas that acknowledged this connection's writes so far): the
        script's reply and the number of replicas that acknowledged it in time (0 when none
        did, or Redis has no replica). ``timeout_s`` bounds the whole; give it room for
        ``wait_ms``."""
        tail = [len(keys), *keys, *args]
        wait: list[Arg] = ["WAIT", 1, wait_ms]
        loop = asyncio.get_running_loop()
        start = loop.time()
        reply, acked = await self.pipeline([["EVALSHA", script.sha, *tail], wait], timeout_s)
        if isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT"):
            if timeout_s is not None:
                timeout_s -= loop.time() - start
                if timeout_s <= 0:
                    raise TimeoutError("no reply within the deadline (EVALSHA, then EVAL)")
            reply, acked = await self.pipeline([["EVAL", script.script, *tail], wait], timeout_s)
        for value in (reply, acked):
            if isinstance(value, BaseException):
                raise value
        return reply, int(acked)

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None

    async def _ready(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connection, however many callers find it gone
            if self._protocol is None or self._protocol.lost is not None:
                self._protocol = await self._connect()
            return self._protocol

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, protocol = await loop.create_connection(_Protocol, self.host, self.port)
            _keepalive(protocol.transport)
            setup = []
            if self._auth:
                setup.append(protocol.send(pack(["AUTH", *self._auth])))
            if self.db:
                setup.append(protocol.send(pack(["SELECT", self.db])))
            try:
                await asyncio.gather(*setup)
            except BaseException:
                if protocol.transport is not None:
                    protocol.transport.close()
                raise
        return protocol


def _keepalive(transport: asyncio.BaseTransport | None) -> None:
    """TCP keepalive on the connection: probes after 10 s idle, every 5 s, 3 unanswered close
    it (where the platform lets the times be set)."""
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
