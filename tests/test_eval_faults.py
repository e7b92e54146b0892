"""Eval runs under pressure: production traffic, foreign requests, two proxies, busy and dead
replicas, no replica to lease, and Redis gone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import redis

from backends.sim.launcher import Replica, ReplicaSpec, launch, stop
from bench.workload import make_episodes
from tests.eval_helpers import admin, begin, chained, client, complete, end
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer
from tests.triton_helpers import http_generate, metric, metrics, request_count

EPISODE = make_episodes(80)[20]


@pytest.fixture(scope="module")
def redis_url(stack: tuple[Proxy, Proxy, LedgerView]) -> str:
    return stack[2].redis_url


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, Proxy, LedgerView]]:
    """Two proxy instances on one Redis, both in front of r1 and r2."""
    redis = RedisServer()
    redis.start()
    proxies = [Proxy([replicas["r1"], replicas["r2"]], redis.url) for _ in range(2)]
    for proxy in proxies:
        proxy.start()
    try:
        yield proxies[0], proxies[1], LedgerView(redis.url)
    finally:
        for proxy in proxies:
            proxy.stop()
        redis.close()


def production(sdk: openai.OpenAI, n: int) -> list[dict[str, Any]]:
    prompts = [f"production request {i}: summarise the incident report" * 3 for i in range(n)]
    with ThreadPoolExecutor(4) as pool:
        return [r[2] for r in pool.map(lambda p: complete(sdk, p), prompts)]


def test_production_avoids_the_leased_replica_and_continuity_is_checked(
    stack: tuple[Proxy, Proxy, LedgerView], replicas: dict[str, Replica]
) -> None:
    """Production never lands on the leased replica; a request behind the proxy's back breaks
    the next record's continuity (verified false, warning header), and only that one."""
    proxy, _, ledger = stack
    sdk = client(proxy, proxy.create_key("arm-c", mode="eval", cache="reset"))
    prod = client(proxy, proxy.create_key("prod-c"))
    run = begin(proxy, "arm-c")
    leased = run["replica"]
    outputs: list[str] = []
    for _ in range(4):
        text, headers, record = complete(sdk, EPISODE.render(outputs))
        outputs.append(text)
        assert {r["replica"] for r in production(prod, 6)} == {"r1", "r2"} - {leased}
        assert record["verified"] is True and "x-kvl-warning" not in headers
    status, _ = http_generate(replicas[leased], {"text_input": "sneaky", "max_tokens": 3})
    assert status == 200
    _, headers, record = complete(sdk, EPISODE.render(outputs))
    assert record["verified"] is False and "1 request(s) outside run" in record["warning"]
    assert headers["x-kvl-warning"] == record["warning"]
    _, headers, record = complete(sdk, EPISODE.render(outputs) + " ")
    assert record["verified"] is True and "x-kvl-warning" not in headers
    end(proxy, run["id"])
    status, body = admin(proxy, "GET", "/admin/replicas")
    assert all(r["leased_by"] is None for r in body["replicas"])
    assert [r["verified"] for r in ledger.tail(run=run["id"])] == [True] * 4 + [False, True]


def test_two_proxies_serve_one_run_one_request_at_a_time(
    stack: tuple[Proxy, Proxy, LedgerView],
) -> None:
    """A run's requests spread over two proxy instances, serially and concurrently, form one
    unbroken chain, every request verified: no two of them overlapped on the replica."""
    first, second, ledger = stack
    key = first.create_key("arm-two", mode="eval", cache="reset")
    sdks = [client(first, key), client(second, key)]
    run = begin(second, "arm-two")["id"]
    outputs: list[str] = []
    for turn in range(6):  # alternating, one after another
        outputs.append(complete(sdks[turn % 2], EPISODE.render(outputs))[0])
    prompts = [f"concurrent {i}: list the files" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:  # all at once, half to each proxy
        results = list(pool.map(lambda i: complete(sdks[i % 2], prompts[i]), range(8)))
    assert {h["x-kvl-run"] for _, h, _ in results} == {run}
    end(first, run)
    records = sorted(ledger.tail(run=run), key=lambda r: r["seq"])
    assert [r["seq"] for r in records] == list(range(14))
    assert chained(records)
    assert all(r["verified"] and r["exact"] for r in records)


def test_run_begin_waits_for_in_flight_requests_then_resets(
    stack: tuple[Proxy, Proxy, LedgerView], replicas: dict[str, Replica]
) -> None:
    """Beginning a run on a busy replica waits for its in-flight request (which completes
    whole), then resets: the request counter restarts and a new generation begins."""
    proxy, _, ledger = stack
    proxy.create_key("arm-busy", mode="eval", cache="reset", replica="r1")
    done: dict[str, Any] = {}

    def long_request() -> None:
        body = {"text_input": "a long cold document. " * 160, "max_tokens": 20}
        done["status"], done["body"] = http_generate(replicas["r1"], body)
        done["at"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 10
    while metric(metrics(replicas["r1"]), "nv_trt_llm_request_metrics", request_type="active") < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    run = begin(proxy, "arm-busy")
    begun = time.monotonic()
    thread.join()
    assert done["status"] == 200 and done["body"]["text_output"]
    assert done["at"] <= begun
    assert int(run["reset_waited_ms"]) > 0 and run["replica"] == "r1"
    assert request_count(replicas["r1"]) == 0
    event = ledger.generations("r1")[-1]
    assert event["run"] == run["id"] and event["generation"] == int(run["generation"])
    end(proxy, run["id"])


def test_a_reset_is_acknowledged_by_the_other_proxy(
    stack: tuple[Proxy, Proxy, LedgerView], redis_url: str
) -> None:
    """A verified reset through one proxy is announced to the other, which sets the replica
    aside and acknowledges at once (the reset waits for that, not for a monitor interval)."""
    proxy, _, _ = stack
    status, report = admin(proxy, "POST", "/admin/replicas/r2/reset")
    assert status == 200, report
    acks = redis.Redis.from_url(redis_url).hgetall("kvl:{replica:r2}:acks")
    assert len(acks) == 1  # the other proxy, not the resetting one
    (mark,) = acks.values()
    assert b"@" in mark


def test_no_free_replica_gets_503_naming_the_holders(
    stack: tuple[Proxy, Proxy, LedgerView],
) -> None:
    """With one replica leased and one kept for production, another arm gets 503 + Retry-After
    and a message that says which run holds what."""
    proxy, _, _ = stack
    proxy.create_key("arm-hold", mode="eval", cache="shared")
    other = client(proxy, proxy.create_key("arm-wait", mode="eval", cache="reset"))
    run = begin(proxy, "arm-hold")
    with pytest.raises(openai.APIStatusError) as refused:
        complete(other, "hello")
    end(proxy, run["id"])
    response = refused.value.response
    assert response.status_code == 503 and response.headers["Retry-After"]
    message = response.json()["error"]["message"]
    assert f"leased by run {run['id']}" in message and "minimum 1" in message


def test_a_dead_leased_replica_breaks_a_pinned_run_and_redis_loss_fails_closed(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """The leased replica of a run pinned to it dies mid-run: the run cannot move (no other
    replica for the pinned key), so it is broken with the reason, 503, lease released, and no
    request is served elsewhere. Without Redis, eval requests get 503 while production flows."""
    with launch([ReplicaSpec("f1")]) as (doomed,):
        proxy = Proxy([replicas["r2"], doomed], redis_server.url)
        proxy.start()
        try:
            sdk = client(proxy, proxy.create_key("arm-f", mode="eval", cache="reset", replica="f1"))
            prod = client(proxy, proxy.create_key("prod-f"))
            _, headers, _ = complete(sdk, "first request")
            run = headers["x-kvl-run"]
            assert complete(prod, "production first")[2]["replica"] == "r2"
            stop(doomed)
            for _ in range(2):
                with pytest.raises(openai.APIStatusError) as failed:
                    complete(sdk, "second request")
                assert failed.value.response.status_code == 503
                message = failed.value.response.json()["error"]["message"]
                assert f"run {run} broken" in message and "cannot move" in message
            status, body = admin(proxy, "GET", f"/admin/runs/{run}")
            assert body["run"]["status"] == "broken" and "f1" in body["run"]["end_reason"]
            assert [
                r["leased_by"] for r in admin(proxy, "GET", "/admin/replicas")[1]["replicas"]
            ] == [None, None]
            redis_server.stop()
            assert complete(prod, "production without redis")[2]["replica"] == "r2"
            with pytest.raises(openai.APIStatusError) as closed:
                complete(sdk, "eval without redis")
            assert closed.value.response.status_code == 503
        finally:
            proxy.stop()


def test_an_idle_run_ends_by_itself_and_the_next_request_begins_another(
    stack: tuple[Proxy, Proxy, LedgerView],
) -> None:
    """A run idle past its key's timeout ends (lease released); the arm's next request begins
    a new run."""
    proxy, _, _ = stack
    sdk = client(proxy, proxy.create_key("arm-idle", mode="eval", cache="shared", idle_timeout_s=1))
    first = complete(sdk, "hello")[1]["x-kvl-run"]
    deadline = time.monotonic() + 15
    while admin(proxy, "GET", f"/admin/runs/{first}")[1]["run"]["status"] == "live":
        assert time.monotonic() < deadline, "the idle run never ended"
        time.sleep(0.2)
    meta = admin(proxy, "GET", f"/admin/runs/{first}")[1]["run"]
    assert meta["status"] == "ended" and meta["end_reason"] == "idle timeout"
    second = complete(sdk, "hello again")[1]["x-kvl-run"]
    assert second != first
    end(proxy, second)


def test_a_reset_that_cannot_reload_in_time_fails_and_names_the_step(
    redis_server: RedisServer,
) -> None:
    """A reset whose unload and load outlast ``[eval] reload_timeout_s`` answers 503 with the
    step and the limit instead of holding its caller; the replica, loaded by Triton anyway,
    serves again under a new generation."""
    with launch([ReplicaSpec("slow1")]) as (replica,):
        extra = "\n[eval]\nreload_timeout_s = 0.2\n"
        proxy = Proxy([replica], redis_server.url, extra=extra)
        proxy.start()
        try:
            prod = client(proxy, proxy.create_key("prod-slow"))
            before = complete(prod, "before the reset")[2]["generation"]
            began = time.monotonic()
            status, body = admin(proxy, "POST", "/admin/replicas/slow1/reset")
            assert status == 503, body
            message = body["error"]["message"]
            assert message.startswith("reset failed: replica slow1") and "0.2 s" in message
            assert time.monotonic() - began < 30
            deadline = time.monotonic() + 60
            while True:
                try:
                    record = complete(prod, "after the failed reset")[2]
                    break
                except openai.APIStatusError:
                    assert time.monotonic() < deadline, "the replica never served again"
                    time.sleep(0.5)
            assert record["replica"] == "slow1" and record["generation"] > before
        finally:
            proxy.stop()
