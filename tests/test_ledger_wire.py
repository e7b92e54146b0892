"""The chain step's own Redis connection (``router.ledger.wire``) against a real redis-server:
scripts by hash and after Redis forgot them, callers that give up, Redis gone and back, AUTH and
a database number from the URL."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from router.ledger.connect import connect
from router.ledger.wire import Wire
from tests.servers import RedisServer

ECHO_LUA = "redis.call('INCR', KEYS[1]); return {ARGV[1], tonumber(ARGV[2]) + 1}"


def wire_for(url: str) -> tuple[aioredis.Redis, Wire]:
    client = connect(url)
    wire = Wire.like(client)
    assert wire is not None
    return client, wire


async def test_a_script_runs_by_hash_and_again_after_redis_forgot_it(
    redis_server: RedisServer,
) -> None:
    client, wire = wire_for(redis_server.url)
    script = client.register_script(ECHO_LUA)
    try:
        assert await wire.script(script, ["n"], [b"x", 41]) == [b"x", 42]
        await client.script_flush()  # what a restarted Redis without its cache looks like
        assert await wire.script(script, ["n"], ["y", 1]) == [b"y", 2]
        assert await client.script_exists(script.sha) == [True]  # EVAL cached it again
        assert await client.get("n") == b"2"  # each call ran exactly once
    finally:
        wire.close()
        await client.aclose()


async def test_a_caller_that_gives_up_leaves_the_connection_in_step(
    redis_server: RedisServer,
) -> None:
    """The reply of a command whose caller timed out is dropped, not handed to the next."""
    client, wire = wire_for(redis_server.url)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await wire.call("BLPOP", "empty-list", "0.3")
        assert await wire.call("ECHO", "mine") == b"mine"
        assert await wire.call("SET", "n", "1") == b"OK"
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await wire.call("LPUSH", "n", "1")
        assert await wire.call("GET", "n") == b"1"
    finally:
        wire.close()
        await client.aclose()


async def test_redis_gone_fails_at_once_and_the_next_call_reconnects(
    redis_server: RedisServer,
) -> None:
    client, wire = wire_for(redis_server.url)
    try:
        assert await wire.call("PING") == b"PONG"
        redis_server.stop()
        with pytest.raises(OSError):
            async with asyncio.timeout(5):  # a hang would fail here, not pass
                await wire.call("PING")
        redis_server.start()
        assert await wire.call("PING") == b"PONG"
    finally:
        wire.close()
        await client.aclose()


async def test_the_urls_user_password_and_database_are_used(redis_server: RedisServer) -> None:
    admin = connect(redis_server.url)
    await admin.execute_command("ACL", "SETUSER", "kvl", "on", ">s3cret", "~*", "+@all")
    await admin.config_set("requirepass", "top")
    port = redis_server.port
    try:
        for url in (f"redis://kvl:s3cret@127.0.0.1:{port}/3", f"redis://:top@127.0.0.1:{port}/3"):
            client, wire = wire_for(url)
            try:
                await wire.call("SET", "where", url)
                assert await client.get("where") == url.encode()  # the same database, 3
            finally:
                wire.close()
                await client.aclose()
        client, wire = wire_for(f"redis://kvl:wrong@127.0.0.1:{port}/0")
        with pytest.raises(ResponseError):
            await wire.call("PING")
        wire.close()
        await client.aclose()
    finally:
        await admin.aclose()


def test_what_it_does_not_speak_stays_on_redis_py() -> None:
    assert Wire.like(aioredis.Redis.from_url("unix:///tmp/redis.sock")) is None
    assert Wire.like(aioredis.Redis.from_url("rediss://127.0.0.1:6380/0")) is None


async def test_a_command_past_its_deadline_fails_and_the_next_gets_its_own_reply(
    redis_server: RedisServer,
) -> None:
    client, wire = wire_for(redis_server.url)
    try:
        with pytest.raises(TimeoutError, match="no reply within 0.05 s"):
            await wire.call("BLPOP", "empty-list", "0.3", timeout_s=0.05)
        assert await wire.call("ECHO", "next", timeout_s=2) == b"next"
    finally:
        wire.close()
        await client.aclose()
