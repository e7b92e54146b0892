"""What a record claims, checked against real Redis and real replicas: unknown first states,
generations that never repeat, exactly-once records through Redis stalls, and the audit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import redis
import urllib3

from backends.sim.launcher import Replica
from router.ledger.chain import genesis
from tests.proxy_harness import Proxy
from tests.servers import RedisServer
from tests.triton_helpers import grpc_generate, reset

HTTP = urllib3.PoolManager(maxsize=16)


def complete(proxy: Proxy, key: str, prompt: str) -> tuple[int, dict[str, Any] | None]:
    response = HTTP.request(
        "POST",
        proxy.url + "/v1/completions",
        body=orjson.dumps({"model": "ensemble", "prompt": prompt, "max_tokens": 4}),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        retries=False,
        timeout=urllib3.Timeout(total=60),
    )
    body = orjson.loads(response.data)
    return response.status, body.get("kvledger")


def stream_records(server: RedisServer, replica: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(server.url)
    try:
        entries = client.xrange(f"kvl:{{replica:{replica}}}:lineage")
        return [orjson.loads(fields[b"r"]) for _id, fields in entries]
    finally:
        client.close()


def audit(server: RedisServer, *more: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "router.cli", "audit", "chain", "--redis-url", server.url]
    command += more
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def spooled(proxy: Proxy) -> float:
    page = HTTP.request("GET", proxy.url + "/metrics").data.decode()
    lines = [line for line in page.splitlines() if line.startswith("kvl_ledger_spooled ")]
    buffered = [line for line in page.splitlines() if line.startswith("kvl_ledger_buffer_depth ")]
    return float(lines[0].split()[1]) + float(buffered[0].split()[1])


def test_a_warm_replica_is_unknown_and_generations_survive_a_flush(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """A proxy meeting a replica that already served requests records an unknown first state,
    not genesis, while a replica just reloaded is proven empty; after FLUSHALL and a restart
    the generations are new numbers, never repeated."""
    r1, r2 = replicas["r1"], replicas["r2"]
    grpc_generate(r1, "warm it up " + uuid.uuid4().hex, max_tokens=2)
    reset(r2)  # loaded just now, nothing served: proven empty when the proxy looks
    proxy = Proxy([r1, r2], redis_server.url, policy="round_robin")
    proxy.start()
    key = proxy.create_key("truth")
    try:
        first = {}
        while len(first) < 2:
            status, record = complete(proxy, key, "first " + uuid.uuid4().hex)
            assert status == 200 and record is not None
            first.setdefault(record["replica"], record)
        assert first["r1"]["state_known"] is False
        assert first["r1"]["state_before"] != genesis(first["r1"]["engine_digest"])
        assert first["r2"]["state_known"] is True
        assert first["r2"]["state_before"] == genesis(first["r2"]["engine_digest"])
        proxy.stop()
        redis.Redis.from_url(redis_server.url).flushall()
        proxy.start()
        key = proxy.create_key("truth")  # Redis forgot the key too
        status, again = complete(proxy, key, "after " + uuid.uuid4().hex)
        assert status == 200 and again is not None
        assert again["generation"] > first[again["replica"]]["generation"]
        assert again["state_known"] is False  # Redis forgot everything: nobody saw it empty
    finally:
        proxy.stop()


def test_records_are_exactly_once_through_redis_stalls(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """Redis paused longer than the proxies' socket timeout, three times, under traffic from two
    proxy instances: every answered request is in the lineage exactly once, the audit finds no
    break, and the same audit finds a record deleted by hand."""
    proxies = [Proxy([replicas["r1"], replicas["r2"]], redis_server.url) for _ in range(2)]
    for proxy in proxies:
        proxy.start()
    key = proxies[0].create_key("stalls")
    answered: list[str] = []
    pending: list[str] = []
    stop = threading.Event()

    def traffic(n: int) -> None:
        while not stop.is_set():
            status, record = complete(proxies[n % 2], key, f"client {n}: {uuid.uuid4().hex}")
            assert status == 200 and record is not None
            answered.append(record["request_id"])
            if record["pending"]:
                pending.append(record["request_id"])

    pauser = redis.Redis.from_url(redis_server.url)
    try:
        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(traffic, n) for n in range(4)]
            for _ in range(3):
                time.sleep(1.0)
                pauser.execute_command("CLIENT", "PAUSE", 1500, "ALL")
                time.sleep(1.6)
            time.sleep(1.0)
            stop.set()
            for done in clients:
                done.result()
        deadline = time.monotonic() + 60
        while any(spooled(p) for p in proxies) and time.monotonic() < deadline:
            time.sleep(0.2)
        ids = [r["request_id"] for rid in ("r1", "r2") for r in stream_records(redis_server, rid)]
        assert len(answered) > 20 and pending  # the stalls did send records the long way
        assert sorted(ids) == sorted(set(ids))  # nothing twice
        assert set(answered) <= set(ids)  # nothing lost
        clean = audit(redis_server)
        assert clean.returncode == 0, clean.stdout + clean.stderr
        assert "every chain holds" in clean.stdout
        entries = pauser.xrange("kvl:{replica:r1}:lineage")
        pauser.xdel("kvl:{replica:r1}:lineage", entries[len(entries) // 2][0])
        tampered = audit(redis_server)
        assert tampered.returncode == 1 and "r1: gap:" in tampered.stdout, tampered.stdout
    finally:
        stop.set()
        pauser.close()
        for proxy in proxies:
            proxy.stop()
