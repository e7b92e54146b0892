"""The chain step's own Redis connection (``router.ledger.wire``) against a real redis-server:
scripts by hash and after Redis forgot them, callers that give up, Redis gone and back, AUTH and
a database number from the URL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from router.ledger.connect import connect
from router.ledger.wire import Wire
from tests.servers import RedisServer

ECHO_LUA = "redis.call('INCR', KEYS[1]); return {ARGV[1], tonumber(ARGV[2]) + 1}"


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[tuple[aioredis.Redis, Wire]]:
    """A redis-py client and a wire to the same Redis (the one a test may stop)."""
    client = connect(redis_server.url)
    wire = Wire.like(client)
    assert wire is not None
    try:
        yield client, wire
    finally:
        wire.close()
        await client.aclose()


async def test_a_script_runs_by_hash_and_again_after_redis_forgot_it(
    pair: tuple[aioredis.Redis, Wire],
) -> None:
    client, wire = pair
    script = client.register_script(ECHO_LUA)
    assert await wire.script(script, ["n"], [b"x", 41]) == [b"x", 42]
    await client.script_flush()  # what a restarted Redis without its cache looks like
    assert await wire.script(script, ["n"], ["y", 1]) == [b"y", 2]
    assert await client.script_exists(script.sha) == [True]  # EVAL cached it again
    assert await client.get("n") == b"2"  # each call ran exactly once


async def test_a_caller_that_gives_up_leaves_the_connection_in_step(
    pair: tuple[aioredis.Redis, Wire],
) -> None:
    """The reply of a command whose caller timed out is dropped, not handed to the next."""
    _, wire = pair
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await wire.call("BLPOP", "empty-list", "0.3")
    assert await wire.call("ECHO", "mine") == b"mine"
    assert await wire.call("SET", "n", "1") == b"OK"
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await wire.call("LPUSH", "n", "1")
    assert await wire.call("GET", "n") == b"1"


async def test_commands_sent_together_leave_in_one_write_and_each_gets_its_own_reply(
    pair: tuple[aioredis.Redis, Wire],
) -> None:
    """Many callers in one turn of the loop (requests ending together): the first, on an idle
    connection, leaves at once; the others, sent while it is on its way, in one write after the
    turn. Every reply still goes to the caller that asked, whatever the mix of answers and
    errors."""
    client, wire = pair
    await wire.call("PING")  # connected
    protocol = wire._protocol
    assert protocol is not None and protocol.transport is not None
    writes: list[bytes] = []
    real_write = protocol.transport.write

    def counted(data: bytes) -> None:
        writes.append(data)
        real_write(data)

    protocol.transport.write = counted  # type: ignore[method-assign]
    calls = [
        wire.call("INCR", "not-a-number-key") if i == 7 else wire.call("ECHO", f"v{i}")
        for i in range(50)
    ]
    await client.set("not-a-number-key", "x")  # the calls start in gather: INCR fails on "x"
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert len(writes) == 2
    assert writes[0].startswith(b"*2\r\n$4\r\nECHO\r\n$2\r\nv0\r\n")
    assert writes[0].count(b"ECHO") == 1 and writes[1].count(b"ECHO") == 48
    assert isinstance(results[7], ResponseError)
    assert [r for i, r in enumerate(results) if i != 7] == [
        f"v{i}".encode() for i in range(50) if i != 7
    ]


async def test_a_command_past_its_deadline_fails_and_the_next_gets_its_own_reply(
    pair: tuple[aioredis.Redis, Wire],
) -> None:
    _, wire = pair
    with pytest.raises(TimeoutError, match="no reply within 0.05 s"):
        await wire.call("BLPOP", "empty-list", "0.3", timeout_s=0.05)
    assert await wire.call("ECHO", "next", timeout_s=2) == b"next"


async def test_each_command_fails_at_its_own_deadline_whatever_was_sent_before(
    pair: tuple[aioredis.Redis, Wire],
) -> None:
    """One timer serves every deadline: a short one sent after a long one (stuck behind a
    blocking command, Redis answers in order) still fails at its own time. A deadline passed
    closes the connection (it may have gone silent): the command still waiting on it fails at
    once with ConnectionError, which the ledger retries through the step key, and the next call
    gets its own reply on a new connection."""
    _, wire = pair
    blocking = asyncio.ensure_future(wire.call("BLPOP", "empty-list", "0.6", timeout_s=5))
    await asyncio.sleep(0)  # sent first
    with pytest.raises(TimeoutError, match="no reply within 0.05 s"):
        await wire.call("ECHO", "late", timeout_s=0.05)
    with pytest.raises(ConnectionError):
        await blocking
    assert await wire.call("ECHO", "next", timeout_s=2) == b"next"


async def test_redis_gone_fails_at_once_and_the_next_call_reconnects(
    pair: tuple[aioredis.Redis, Wire], redis_server: RedisServer
) -> None:
    _, wire = pair
    assert await wire.call("PING") == b"PONG"
    redis_server.stop()
    with pytest.raises(OSError):
        async with asyncio.timeout(5):  # a hang would fail here, not pass
            await wire.call("PING")
    redis_server.start()
    assert await wire.call("PING") == b"PONG"


async def test_the_urls_user_password_and_database_are_used(
    pair: tuple[aioredis.Redis, Wire], redis_server: RedisServer
) -> None:
    admin, _ = pair
    await admin.execute_command("ACL", "SETUSER", "kvl", "on", ">s3cret", "~*", "+@all")
    await admin.config_set("requirepass", "top")
    port = redis_server.port
    urls = [f"redis://kvl:s3cret@127.0.0.1:{port}/3", f"redis://:top@127.0.0.1:{port}/3"]
    for url in [*urls, f"redis://kvl:wrong@127.0.0.1:{port}/3"]:
        client = connect(url)
        wire = Wire.like(client)
        assert wire is not None
        try:
            if url in urls:
                await wire.call("SET", "where", url)
                assert await client.get("where") == url.encode()  # the same database, 3
            else:
                with pytest.raises(ResponseError):
                    await wire.call("PING")
        finally:
            wire.close()
            await client.aclose()


def test_what_it_does_not_speak_stays_on_redis_py() -> None:
    assert Wire.like(aioredis.Redis.from_url("unix:///tmp/redis.sock")) is None
    assert Wire.like(aioredis.Redis.from_url("rediss://127.0.0.1:6380/0")) is None


async def test_every_kind_of_argument_reaches_redis_as_its_bytes(
    pair: tuple[aioredis.Redis, Wire],
) -> None:
    """Whatever a caller passes (text in any script, bytes with CR LF and NUL in them, numbers,
    flags, buffers, a record of a megabyte) Redis stores exactly the bytes meant, and the
    connection stays in step for the next command."""
    client, wire = pair
    values: list[object] = ["plain", "é ü 漢字 \U0001f600", b"a\r\nb\x00c", b"", 0, -7, 2**70]
    values += [True, False, 1.5, bytearray(b"buf"), memoryview(b"view"), b"r" * 1_000_000]
    expected = [b"plain", "é ü 漢字 \U0001f600".encode(), b"a\r\nb\x00c", b"", b"0", b"-7"]
    expected += [str(2**70).encode(), b"1", b"0", b"1.5", b"buf", b"view", b"r" * 1_000_000]
    assert await wire.call("RPUSH", "kinds", *values, timeout_s=5) == len(values)  # type: ignore[arg-type]
    assert await client.lrange("kinds", 0, -1) == expected
    assert await wire.call("PING") == b"PONG"
