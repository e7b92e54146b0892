"""Eval runs that fail loudly and resets that survive their proxy: leases held through long
requests, a lost lease that breaks the run, a proxy killed mid-reset, a reset of an unloaded
model."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import openai
import pytest
import redis

from backends.sim.launcher import Replica, ReplicaSpec, launch
from tests.eval_helpers import admin, begin, cli, client, complete, end
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

LONG_PROMPT = "Summarise every clause of the contract, then list the open questions. " * 40


def window(record: dict[str, Any]) -> tuple[float, float]:
    """When a request was served: from its arrival to its record (seconds since the epoch)."""
    end_ = datetime.fromisoformat(record["at"]).timestamp()
    return end_ - record["latency_ms"] / 1000, end_


def overlaps(record: dict[str, Any], start: float, end_: float) -> bool:
    begin_, finish = window(record)
    return begin_ < end_ and finish > start


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, RedisServer]]:
    """One proxy in front of r1 and r2 (reuse on), with its own Redis."""
    server = RedisServer()
    server.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], server.url)
    proxy.start()
    try:
        yield proxy, server
    finally:
        proxy.stop()
        server.close()


def test_a_request_longer_than_the_idle_timeout_keeps_the_lease(
    stack: tuple[Proxy, RedisServer],
) -> None:
    """An arm whose idle timeout is shorter than its request: the run keeps its lease while the
    request runs (production never lands there meanwhile) and the record stays verified."""
    proxy, server = stack
    key = proxy.create_key("arm-slow", mode="eval", cache="shared", idle_timeout_s=0.5)
    arm = client(proxy, key)
    prod = client(proxy, proxy.create_key("prod-slow"))
    result: dict[str, Any] = {}

    def slow() -> None:
        result["text"], result["headers"], result["record"] = complete(arm, LONG_PROMPT)

    worker = threading.Thread(target=slow)
    worker.start()
    while worker.is_alive():
        complete(prod, "production " + uuid.uuid4().hex)
    worker.join()
    record = result["record"]
    assert record["latency_ms"] > 1000, "the request must outlive the idle timeout twice over"
    assert record["warning"] is None, record["warning"]
    assert record["verified"] is True and record["exact"] is True
    # Production requests that overlapped the eval request's service never ran on its replica.
    start, end_ = window(record)
    overlapping = [
        r for r in LedgerView(server.url).tail(1000, key="prod-slow") if overlaps(r, start, end_)
    ]
    assert overlapping and all(r["replica"] != record["replica"] for r in overlapping)
    end(proxy, record["run"])


def test_a_run_that_lost_its_lease_is_broken_and_says_why(
    stack: tuple[Proxy, RedisServer],
) -> None:
    """When the lease vanishes under a run, its next request answers 503 with the reason, and
    so does every later one until a new run begins."""
    proxy, server = stack
    sdk = client(proxy, proxy.create_key("arm-lost", mode="eval", cache="reset"))
    run = begin(proxy, "arm-lost")
    complete(sdk, "first " + uuid.uuid4().hex)
    redis.Redis.from_url(server.url).delete(f"kvl:{{replica:{run['replica']}}}:lease")
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as refused:
            complete(sdk, "second " + uuid.uuid4().hex)
        assert refused.value.status_code == 503
        assert "lost its lease" in refused.value.message
    status, shown = admin(proxy, "GET", f"/admin/runs/{run['id']}")
    assert status == 200 and shown["run"]["status"] == "broken"
    fresh = begin(proxy, "arm-lost")
    assert complete(sdk, "third " + uuid.uuid4().hex)[1]["x-kvl-run"] == fresh["id"]
    end(proxy, fresh["id"])


@pytest.fixture
def own_replica() -> Iterator[Replica]:
    """A replica of this test's own: killing a proxy mid-reset must not touch the shared ones."""
    with launch([ReplicaSpec("k1")]) as running:
        yield running[0]


def test_a_proxy_killed_mid_reset_leaves_a_replica_that_serves_again(
    own_replica: Replica, redis_server: RedisServer
) -> None:
    """kill -9 of the proxy in the middle of a verified reset (once the model is unloading):
    after a restart the replica serves again within a bounded time, in a new generation; the
    run says its reset was interrupted; the arm's requests meanwhile get a fast 503 with
    Retry-After."""
    import tritonclient.http as httpclient

    proxy = Proxy([own_replica], redis_server.url, extra="[eval]\nmin_production_replicas = 0")
    proxy.start()
    ledger = LedgerView(redis_server.url)
    # A hanging answer would end in a timeout, not the 503 the test expects.
    sdk = client(proxy, proxy.create_key("arm-k", mode="eval", cache="reset")).with_options(
        timeout=20
    )
    prod = client(proxy, proxy.create_key("prod-k"))
    before = complete(prod, "before " + uuid.uuid4().hex)[2]["generation"]
    beginning = threading.Thread(target=lambda: cli(proxy, "runs", "begin", "arm-k"))
    beginning.start()
    # Not a fixed sleep: on a slow machine the CLI may not have reached the reset by then.
    triton = httpclient.InferenceServerClient(own_replica.http_url.removeprefix("http://"))
    deadline = time.monotonic() + 60
    while triton.is_model_ready("ensemble"):
        assert time.monotonic() < deadline, "the reset never began to unload the model"
        time.sleep(0.01)
    assert proxy.process is not None
    os.kill(proxy.process.pid, signal.SIGKILL)
    proxy.process.wait()
    beginning.join()
    proxy.start()
    try:
        with pytest.raises(openai.APIStatusError) as refused:
            complete(sdk, "during " + uuid.uuid4().hex)
        assert refused.value.status_code == 503
        assert refused.value.response.headers.get("retry-after")
        deadline = time.monotonic() + 60
        while True:
            try:
                after = complete(prod, "after " + uuid.uuid4().hex)[2]
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline, "the replica did not serve again"
                time.sleep(0.5)
        assert after["generation"] > before
        runs = admin(proxy, "GET", "/admin/runs?arm=arm-k")[1]["runs"]
        assert runs[0]["status"] == "failed" and "interrupted" in runs[0]["end_reason"]
        reasons = [g["reason"] for g in ledger.generations("k1")]
        assert any("interrupted" in r or "verified reset" in r for r in reasons[1:]), reasons
    finally:
        proxy.stop()


def test_replicas_reset_works_on_an_unloaded_model(
    own_replica: Replica, redis_server: RedisServer
) -> None:
    """A model left unloaded (an earlier reset died) is simply loaded by `replicas reset`."""
    import tritonclient.http as httpclient

    triton = httpclient.InferenceServerClient(own_replica.http_url.removeprefix("http://"))
    proxy = Proxy([own_replica], redis_server.url)
    proxy.start()
    try:
        triton.unload_model("ensemble", unload_dependents=True)
        done = cli(proxy, "replicas", "reset", "k1")
        assert done.returncode == 0, done.stderr
        assert triton.is_model_ready("ensemble")
        prod = client(proxy, proxy.create_key("prod-u"))
        record = complete(prod, "served " + uuid.uuid4().hex)[2]
        assert record["state_known"] is True and record["seq"] == 0
    finally:
        triton.close()
        proxy.stop()
