"""No leaked flights: whatever escapes from a replica's stream, the request ends its flight.

The backend here is a fake on purpose (a replica that fails in a way no real one does on
demand); the app, the ledger and Redis are real.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from backends.base import Backend, Chunk, EngineFacts, GenerationRequest, ReplicaCounters
from router.http.app import create_app
from router.http.context import FLEET
from router.ledger.keys import KeyStore, Profile
from router.settings import Settings, build_settings
from tests.servers import RedisServer


class Broken:
    """A replica whose stream yields a piece, then raises what no handler expects."""

    replica_id = "f1"

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        yield Chunk("partial ")
        await asyncio.sleep(0)
        b"\xff".decode()  # UnicodeDecodeError: what a garbled engine response would raise

    async def reset(self, timeout_s: float) -> None: ...

    async def load(self, timeout_s: float) -> None: ...

    async def model_state(self) -> str:
        return "READY"

    async def ready(self) -> bool:
        return True

    async def engine_digest(self) -> str:
        return "fake-engine"

    async def max_input_len(self) -> int | None:
        return None

    async def engine_facts(self) -> EngineFacts:
        return EngineFacts()

    async def counters(self) -> ReplicaCounters:
        return ReplicaCounters(ready=True, request_count=1)

    async def request_count(self) -> int:
        return 1

    async def close(self) -> None: ...


def settings(redis_url: str, spool: Path) -> Settings:
    raw = {
        "server": {"redis_url": redis_url, "monitor_interval_s": 0.2},
        "lineage": {"spool_path": str(spool)},
        "replicas": [{"id": "f1", "grpc": "unused:1", "metrics": "http://unused/metrics"}],
    }
    return build_settings(raw, {}, spool.parent)


class Answering(Broken):
    """A replica that answers at once, and notes in which task its stream was closed."""

    def __init__(self) -> None:
        self.closed_in: list[str] = []

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        try:
            yield Chunk("done", final=True)
        finally:
            task = asyncio.current_task()
            self.closed_in.append(type(task.get_coro()).__name__ if task else "none")


@pytest.fixture
def backend() -> Backend:
    return Broken()


@pytest.fixture
async def app_client(
    redis_server: RedisServer, tmp_path: Path, backend: Backend
) -> AsyncIterator[TestClient]:
    def backends(_s: Settings, _h: aiohttp.ClientSession) -> Mapping[str, Backend]:
        return {"f1": backend}

    app = create_app(settings(redis_server.url, tmp_path / "spool.jsonl"), backends=backends)
    async with TestClient(TestServer(app)) as client:
        yield client


async def _key(redis_server: RedisServer, name: str) -> dict[str, str]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        key = await KeyStore(client).create(Profile(name=name))
    finally:
        await client.aclose()
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("backend", [Answering()], ids=["answering"])
async def test_a_finished_stream_is_closed_by_its_request_not_left_to_the_event_loop(
    app_client: TestClient, redis_server: RedisServer, backend: Answering
) -> None:
    """A flight that got its last chunk closes its stream itself: left open, the event loop
    would finalize it later in a task of its own (a thread-safe wake-up and a task per
    request, which the overhead benchmark counts)."""
    headers = await _key(redis_server, "tidy")
    body = {"model": "ensemble", "prompt": "hello", "max_tokens": 4}
    plain = await app_client.post("/v1/completions", data=orjson.dumps(body), headers=headers)
    streamed = await app_client.post(
        "/v2/models/ensemble/generate_stream",
        data=orjson.dumps({"text_input": "hello", "max_tokens": 4}),
        headers=headers,
    )
    assert plain.status == 200 and streamed.status == 200
    assert b"done" in await streamed.read()
    for _ in range(50):  # a stream left to the finalizer closes a loop turn or two later
        await asyncio.sleep(0.01)
    assert len(backend.closed_in) == 2
    assert "async_generator_athrow" not in backend.closed_in, backend.closed_in


async def test_an_unexpected_error_mid_stream_still_ends_the_flight(
    app_client: TestClient, redis_server: RedisServer
) -> None:
    """A decode error inside the backend stream: the client gets an error (a stream ends with an
    error event, it does not hang), the replica's load drops back to zero and the request
    leaves a record with status error."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    key = await KeyStore(client).create(Profile(name="victim"))
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "ensemble", "prompt": "hello", "max_tokens": 4}
    plain = await app_client.post("/v1/completions", data=orjson.dumps(body), headers=headers)
    assert plain.status == 500 and (await plain.json())["error"]["type"] == "server_error"
    streamed = await app_client.post(
        "/v2/models/ensemble/generate_stream",
        data=orjson.dumps({"text_input": "hello", "max_tokens": 4}),
        headers=headers,
    )
    events = (await asyncio.wait_for(streamed.read(), 10)).split(b"\n\n")
    assert b"partial" in events[0] and b'"error"' in events[-2]
    fleet = app_client.app[FLEET] if app_client.app is not None else None
    assert fleet is not None and fleet["f1"].in_flight == 0
    entries = []
    for _ in range(100):
        entries = await client.xrange("kvl:{replica:f1}:lineage")
        if len(entries) == 2:
            break
        await asyncio.sleep(0.05)
    statuses = [orjson.loads(fields[b"r"])["status"] for _id, fields in entries]
    assert statuses == ["error", "error"]
    await client.aclose()
