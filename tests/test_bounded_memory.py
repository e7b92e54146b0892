"""Memory stays flat under abuse: 100,000 distinct made-up API keys and 200 slow clients.

The proxy's resident memory is read from /proc before and after, in the same run: growth is
bounded by a figure far below what remembering every key would cost (each one costs a few
hundred bytes in a cache: 80,000 of them about 20 MiB).
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from backends.sim.launcher import Replica
from router.cli.local import ProxyProcess, create_key
from tests.hostile_http import bearer, post_json
from tests.hostile_stack import hostile_proxy
from tests.servers import RedisServer

WARM_KEYS = 20_000  # fills the caches and the allocator's pools before the first reading
KEYS = 100_000
SLOW_CLIENTS = 200
GROWTH_BOUND_KIB = 8 * 1024
_REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer made-up-%d\r\n\r\n"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _connection(port: int, keys: range, batch: int) -> int:
    """Pipelined GET /v1/models with one made-up key each; the count of 401s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    unauthorized = 0
    try:
        for start in range(keys.start, keys.stop, batch):
            chunk = range(start, min(start + batch, keys.stop))
            writer.write(b"".join(_REQUEST % i for i in chunk))
            seen, data = 0, b""
            while seen < len(chunk):
                data += await reader.read(1 << 16)
                seen = data.count(b"HTTP/1.1 ")
            unauthorized += data.count(b"HTTP/1.1 401 ")
    finally:
        writer.close()
    return unauthorized


def flood(port: int, keys: range, connections: int = 8, batch: int = 250) -> int:
    """Send every key in ``keys`` once, over a few keep-alive connections; the 401 count."""
    step = -(-len(keys) // connections)
    parts = [range(s, min(s + step, keys.stop)) for s in range(keys.start, keys.stop, step)]

    async def run() -> int:
        return sum(await asyncio.gather(*(_connection(port, p, batch) for p in parts)))

    return asyncio.run(run())


def slow_clients(port: int, key: str, count: int) -> list[socket.socket]:
    """Half send a request line and half a header, never more; half promise a body and stall."""
    sockets = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        else:
            body = orjson.dumps({"model": "ensemble", "prompt": "slow"})
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + key.encode()
                + b"\r\nContent-Length: 100000\r\n\r\n"
                + body[:10]
            )
        sockets.append(sock)
    return sockets


@pytest.fixture
def proxy(replicas: dict[str, Replica], redis_server: RedisServer) -> Iterator[ProxyProcess]:
    proxy = hostile_proxy([replicas["r1"]], redis_server.url)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


def test_made_up_keys_and_slow_clients_leave_memory_flat(proxy: ProxyProcess) -> None:
    """100,000 distinct unknown keys (all 401) and 200 stalled clients: RSS growth stays under
    8 MiB, and the proxy serves a real client throughout."""
    assert proxy.process is not None
    key = create_key(proxy.redis_url, "memory")
    assert flood(proxy.port, range(WARM_KEYS)) == WARM_KEYS
    stalled = slow_clients(proxy.port, key, SLOW_CLIENTS)
    try:
        before = rss_kib(proxy.process.pid)
        assert flood(proxy.port, range(WARM_KEYS, KEYS)) == KEYS - WARM_KEYS
        after = rss_kib(proxy.process.pid)
        body = {"model": "ensemble", "prompt": uuid.uuid4().hex, "max_tokens": 2}
        assert post_json(proxy.port, "/v1/completions", body, bearer(key)).status == 200
    finally:
        for sock in stalled:
            sock.close()
    print(
        f"\nproxy RSS: {before / 1024:.1f} MiB after {WARM_KEYS} unknown keys and"
        f" {SLOW_CLIENTS} slow clients, {after / 1024:.1f} MiB after {KEYS} keys:"
        f" {(after - before) / 1024:+.1f} MiB"
    )
    assert after - before < GROWTH_BOUND_KIB
