"""Faults: Redis gone mid-traffic, a client gone mid-stream. No request hangs, no record is lost."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
import urllib3

from backends.sim.launcher import Replica, ReplicaSpec, launch, stop
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer
from tests.triton_helpers import metric, metrics

HTTP = urllib3.PoolManager()


@pytest.fixture
def own_stack(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> Iterator[tuple[Proxy, str, LedgerView, RedisServer]]:
    """A proxy with a Redis this test may stop and start."""
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis_server.url)
    proxy.start()
    try:
        yield proxy, proxy.create_key("faults"), LedgerView(redis_server.url), redis_server
    finally:
        proxy.stop()


def complete(proxy: Proxy, key: str, prompt: str) -> urllib3.BaseHTTPResponse:
    body = orjson.dumps({"model": "ensemble", "prompt": prompt, "max_tokens": 4})
    return HTTP.request(
        "POST",
        proxy.url + "/v1/completions",
        body=body,
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        retries=False,
    )


def test_redis_outage_loses_no_record(
    own_stack: tuple[Proxy, str, LedgerView, RedisServer],
) -> None:
    """Redis stopped mid-traffic: every request succeeds; afterwards one record per request."""
    proxy, key, ledger, redis = own_stack
    tag = uuid.uuid4().hex
    sent: list[str] = []
    pending_headers = 0
    for i in range(36):
        if i == 12:
            redis.stop()
        if i == 24:
            redis.start()
        response = complete(proxy, key, f"{tag} request {i}")
        assert response.status == 200, response.data
        sent.append(response.headers["X-Request-Id"])
        pending_headers += response.headers.get("X-Kvl-Pending") == "true"
    assert pending_headers >= 12  # at least the requests served while Redis was down
    deadline = time.monotonic() + 20
    stored: list[str] = []
    while time.monotonic() < deadline:
        stored = [r["request_id"] for r in ledger.tail(5000, key="faults")]
        if len(stored) >= len(sent):
            break
        time.sleep(0.25)
    assert sorted(stored) == sorted(sent)
    records = {r["request_id"]: r for r in ledger.tail(5000, key="faults")}
    late = [records[rid] for rid in sent if records[rid]["pending"]]
    assert late and all(r["state_after"] for r in late)


def open_stream_and_leave(proxy: Proxy, key: str, events: int) -> str | None:
    """Start a long stream, read ``events`` events, then close the socket; the replica id.

    None when the model ended the stream by itself first (the stand-in's random weights emit
    the end token now and then), so the caller tries another prompt.
    """
    body = orjson.dumps({"text_input": "long " + uuid.uuid4().hex, "max_tokens": 3000})
    request = (
        f"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=90) as sock:
        sock.sendall(request)
        received = b""
        while received.count(b"data: ") < events:
            data = sock.recv(65536)
            if not data or b"kvledger" in data:
                return None
            received += data
    return next(
        line.split(b": ")[1].decode()
        for line in received.split(b"\r\n")
        if line.lower().startswith(b"x-kvl-replica")
    )


def test_client_gone_mid_stream_cancels_and_records(
    own_stack: tuple[Proxy, str, LedgerView, RedisServer], replicas: dict[str, Replica]
) -> None:
    """A client that disconnects mid-stream: the replica stops generating, a cancelled record."""
    proxy, key, ledger, _ = own_stack
    replica = None
    for _ in range(10):
        replica = open_stream_and_leave(proxy, key, events=20)
        if replica is not None:
            break
    assert replica is not None, "no prompt streamed 20 tokens"
    deadline = time.monotonic() + 20
    records: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        records = [r for r in ledger.tail(100, key="faults") if r["status"] == "cancelled"]
        if records:
            break
        time.sleep(0.2)
    assert len(records) == 1, proxy.log[-3000:]
    assert records[0]["replica"] == replica
    assert records[0]["state_after"], "the cancelled request still advanced the chain"
    # The replica went idle long before 3000 tokens: generation was cancelled inside Triton.
    active = "nv_trt_llm_request_metrics"
    while time.monotonic() < deadline:
        if metric(metrics(replicas[replica]), active, request_type="active") == 0:
            break
        time.sleep(0.2)
    first = metric(
        metrics(replicas[replica]), "nv_trt_llm_general_metrics", general_type="iteration_counter"
    )
    time.sleep(1.0)
    second = metric(
        metrics(replicas[replica]), "nv_trt_llm_general_metrics", general_type="iteration_counter"
    )
    assert first == second


def test_client_gone_before_the_first_token_is_still_recorded(
    own_stack: tuple[Proxy, str, LedgerView, RedisServer],
) -> None:
    """A client that leaves during a long prefill, before any token: its request may have
    filled cache blocks, so it leaves a record (cancelled) and its replica's chain moves."""
    proxy, key, ledger, _ = own_stack
    prompt = "A long cold document to read before answering. " * 80 + uuid.uuid4().hex
    body = orjson.dumps({"model": "ensemble", "prompt": prompt, "max_tokens": 4, "stream": True})
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    time.sleep(0.3)  # the proxy has sent it on; the prefill of ~4,000 bytes takes longer
    sock.close()
    deadline = time.monotonic() + 30
    while not (found := ledger.tail(10, key="faults")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r["status"] for r in found] == ["cancelled"], found
    assert found[0]["state_after"] and found[0]["output_digest"]


def test_replica_down_moves_production_requests(redis_server: RedisServer) -> None:
    """A replica killed behind the proxy: production requests still succeed, on the other one."""
    with launch([ReplicaSpec("down-a"), ReplicaSpec("down-b")]) as (a, b):
        proxy = Proxy([a, b], redis_server.url, policy="round_robin", monitor_interval_s=30)
        proxy.start()
        try:
            key = proxy.create_key("failover")
            stop(a)  # the monitor will not notice for 30 s: dispatch must handle it
            placed = []
            for i in range(6):
                response = complete(proxy, key, f"after the crash {i}")
                assert response.status == 200, proxy.log[-4000:]
                placed.append(response.headers["X-Kvl-Replica"])
            assert set(placed) == {"down-b"}
        finally:
            proxy.stop()
