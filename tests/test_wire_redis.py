"""The chain step's way to Redis under faults a NAT or a failover makes: a connection that goes
silent (packets dropped, no close), a reply lost after Redis ran the step; and a request that
may have run unrecorded (``Ledger.lost``). The chain recovers, each record is written once, the
audit stays clean."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import structlog

from router.ledger import Ledger, LedgerConfig
from tests.ledger_helpers import fresh_chain, lineage, make_ledger, record, spool_line, until
from tests.servers import RedisServer


class Silencer:
    """A TCP proxy in front of Redis. ``silence()``: every connection open now stops passing
    bytes either way, silently (no close, as a NAT that forgot the flow); later connections
    pass. ``drop_reply_to(word)``: the next command containing ``word`` goes to Redis, but
    nothing Redis answers on that connection comes back."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.port = 0
        self.generation = 0  # connections of an older generation are silenced
        self._drop_word: bytes | None = None
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Silencer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def silence(self) -> None:
        self.generation += 1

    def drop_reply_to(self, word: bytes) -> None:
        self._drop_word = word

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        born = self.generation
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        mute = [False]  # replies on this connection are dropped

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if self.generation != born:
                        continue  # silently dropped
                    if up and self._drop_word is not None and self._drop_word in data:
                        self._drop_word = None
                        mute[0] = True
                    if not up and mute[0]:
                        continue
                    dst.write(data)
                    await dst.drain()
            dst.close()

        tasks = [
            asyncio.create_task(pump(reader, up_writer, True)),
            asyncio.create_task(pump(up_reader, writer, False)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)


@contextlib.asynccontextmanager
async def through(
    redis_server: RedisServer, tmp_path: Path, **config: object
) -> AsyncIterator[tuple[Silencer, Ledger, aioredis.Redis]]:
    """A ledger whose Redis connections (its wire's and redis-py's) pass the silencer."""
    async with Silencer(redis_server.port) as silencer:
        client = aioredis.Redis(
            host="127.0.0.1", port=silencer.port, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        direct = aioredis.Redis.from_url(redis_server.url)
        settings: dict[str, Any] = {"retry_interval_s": 0.1, "close_timeout_s": 2.0, **config}
        cfg = LedgerConfig(spool_path=tmp_path / "spool", **settings)
        ledger = Ledger(client, cfg, structlog.get_logger("kvledger.ledger"))
        try:
            yield silencer, ledger, direct
        finally:
            await ledger.close()
            await client.aclose()
            await direct.aclose()


async def audit_clean(ledger: Ledger, replica: str = "r1") -> None:
    (audit,) = await ledger.audit([replica])
    assert audit.ok, audit.findings
    assert audit.counts["duplicate"] == 0


async def test_a_connection_gone_silent_is_dropped_and_the_chain_recovers(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Every open connection to Redis goes silent (no close, no reset): the step on its way
    times out once, the connection is closed, and within a few timeouts the chain steps again
    on a new one; every record is written once, in order."""
    async with through(redis_server, tmp_path) as (silencer, ledger, direct):
        await ledger.start()
        head = await fresh_chain(ledger)
        for i in range(3):
            assert not (await ledger.commit(record(i, generation=head.generation)))["pending"]
        silencer.silence()
        answered = [await ledger.commit(record(i, generation=head.generation)) for i in range(3, 6)]
        assert answered[0]["pending"]  # the one that met the silence
        await until(lambda: ledger.redis_up, timeout_s=5)  # a few timeouts, not minutes
        late = await ledger.commit(record(6, generation=head.generation))
        assert not late["pending"] and late["seq"] == 6
        stored = await lineage(direct)
        assert [r["request_id"] for r in stored] == [f"req-{i:04d}" for i in range(7)]
        await audit_clean(ledger)


async def test_a_step_retried_after_its_key_expired_is_recorded_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A late step the writer sent, which Redis ran but whose reply was lost, retried after
    its step key expired: it is not run again as a second certain step (the writer marked it
    tried before sending, and the record key still holds its answer): one record."""
    spool = tmp_path / "spool"
    async with through(redis_server, tmp_path, step_ttl_s=1, retry_interval_s=1.5) as (
        silencer,
        ledger,
        direct,
    ):
        head = await fresh_chain(make_ledger(direct, tmp_path / "other"))
        spool.write_bytes(spool_line(record(0, generation=head.generation)))
        silencer.drop_reply_to(b"EVALSHA")  # Redis runs the step; its reply never comes back
        await ledger.start()
        tried = tmp_path / "spool.tried"
        await until(lambda: tried.exists() and tried.read_text().startswith("req-0000 "))
        await until(lambda: ledger.stats()["written_total"] == 1, timeout_s=10)
        stored = await lineage(direct)
        assert [r["request_id"] for r in stored] == ["req-0000"]
        assert stored[0]["unordered"] is False and stored[0]["seq"] == 0
        assert await direct.ttl("kvl:{replica:r1}:step:req-0000") in (-2, -1, 0, 1)
        await audit_clean(ledger)


@pytest.mark.parametrize("redis_down", [False, True])
async def test_a_request_lost_on_its_replica_makes_its_state_unknown(
    redis_server: RedisServer, tmp_path: Path, redis_down: bool
) -> None:
    """``Ledger.lost``: the request may have run unrecorded; its record says so and the chain
    moves to an unknown state (now, or once Redis is back), and every later record descends
    from it; the audit counts it, and finds nothing wrong."""
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=0.5)
    ledger = make_ledger(client, tmp_path / "spool")
    try:
        await ledger.start()
        head = await fresh_chain(ledger)
        await ledger.commit(record(0, generation=head.generation))
        if redis_down:
            redis_server.stop()
        lost = await ledger.lost(record(1, generation=head.generation), "dropped after the write")
        assert lost["warning"] == "dropped after the write"
        if redis_down:
            assert lost["pending"]
            redis_server.start()
            await until(lambda: ledger.stats()["written_total"] == 1, timeout_s=10)
        else:
            assert lost["unordered"] and not lost["exact"] and lost["status"] == "ok"
        after = await ledger.commit(record(2, generation=head.generation))
        assert after["state_known"] is False and after["seq"] == 2
        stored = await lineage(client)
        assert [r["unordered"] for r in stored] == [False, True, False]
        (audit,) = await ledger.audit(["r1"])
        assert audit.ok and audit.counts["unordered"] == 1
        assert not (await ledger.head("r1")).known
    finally:
        await ledger.close()
        await client.aclose()


async def test_one_deadline_covers_evalsha_and_its_eval(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis forgot its scripts (NOSCRIPT): the step still runs by EVAL within the same
    deadline, once."""
    client = aioredis.Redis.from_url(redis_server.url)
    ledger = make_ledger(client, tmp_path / "spool")
    try:
        await ledger.start()
        head = await fresh_chain(ledger)
        await client.script_flush()
        done = await ledger.commit(record(0, generation=head.generation))
        assert not done["pending"] and done["seq"] == 0
        await audit_clean(ledger)
    finally:
        await ledger.close()
        await client.aclose()
