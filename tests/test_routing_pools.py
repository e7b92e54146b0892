"""Production routing through real proxies: the production pool, conversations that stay on
the replica holding them, and independent proxies that agree on where a conversation lives."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
import urllib3

from backends.sim.launcher import Replica, config_snippet
from policies import DEFAULT_POLICY, prefix_block_hashes, rendezvous_order
from router.cli.local import ProxyProcess, create_key
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

HTTP = urllib3.PoolManager()
TOKEN = "admin-secret"  # what tests.proxy_harness gives the proxy
TAIL = "You are the support agent of a hosting company. Answer briefly, cite the docs. " * 3


def system_prompt_homed_on(replica: str) -> str:
    """A system prompt whose first block rendezvous-hashes to ``replica`` among r1..r3: where
    first-block affinity would send every turn of its conversations, as in issue 14."""
    for n in range(1000):
        system = f"{n:05d} {TAIL}"
        first = prefix_block_hashes(f"<|system|>\n{system}\n", 16, 1)[0]
        if rendezvous_order(first, ["r1", "r2", "r3"])[0] == replica:
            return system
    raise AssertionError("no system prompt maps to " + replica)


SYSTEM = system_prompt_homed_on("r3")


@pytest.fixture(scope="module")
def pair(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, Proxy, str]]:
    """Two proxies (the default policy) in front of r1, r2 and r3 (reuse off), one Redis."""
    redis = RedisServer()
    redis.start()
    fleet = [replicas["r1"], replicas["r2"], replicas["r3"]]
    proxies = [Proxy(fleet, redis.url, policy=DEFAULT_POLICY) for _ in range(2)]
    try:
        for proxy in proxies:
            proxy.start()
        yield proxies[0], proxies[1], proxies[0].create_key("routing-pools")
    finally:
        for proxy in proxies:
            proxy.stop()
        redis.close()


def sdk(proxy: ProxyProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=120)


def turn(proxy: ProxyProcess, key: str, messages: list[Any]) -> tuple[dict[str, Any], int]:
    """One chat turn: appends the reply to ``messages``; the record and the cached tokens."""
    reply = sdk(proxy, key).chat.completions.create(
        model="ensemble", max_tokens=8, messages=messages
    )
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return (reply.model_extra or {})["kvledger"], cached


def get(url: str, **headers: str) -> tuple[int, Any]:
    response = HTTP.request("GET", url, headers=headers, timeout=30, retries=False)
    return response.status, orjson.loads(response.data)


def test_five_turn_chat_reuses_the_cache_on_a_reuse_replica(
    pair: tuple[Proxy, Proxy, str],
) -> None:
    """Issue 14's conversation, whose first block hashes to the reuse-off r3: every turn on
    one reuse replica, and turns 2 to 5 report cached tokens."""
    proxy, _, key = pair
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    served = []
    for n in range(5):
        messages.append({"role": "user", "content": f"Question {n}: why is my site slow?"})
        record, cached = turn(proxy, key, messages)
        served.append((record["replica"], cached))
    assert {replica for replica, _ in served} <= {"r1", "r2"}
    assert len({replica for replica, _ in served}) == 1
    assert all(cached > 0 for _, cached in served[1:]), served


def warm(proxy: ProxyProcess, key: str, label: str) -> None:
    """Other conversations on the same system prompt, so the proxy has seen it shared."""
    for n in range(2):
        question = f"{label} warm-up question {n}"
        turn(
            proxy,
            key,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )


def test_two_proxies_agree_on_a_new_conversations_replica(
    pair: tuple[Proxy, Proxy, str],
) -> None:
    """Proxies that never talked send a new conversation to the same replica, and its next
    turn through the other proxy finds its first turn in that replica's cache."""
    proxy_a, proxy_b, key = pair
    warm(proxy_a, key, "a")
    warm(proxy_b, key, "b")
    system_tokens = len(f"<|system|>\n{SYSTEM}\n".encode())
    for n in range(3):
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"new {n}"}]
        via_a, _ = turn(proxy_a, key, list(first))
        via_b, _ = turn(proxy_b, key, list(first))
        assert via_a["replica"] == via_b["replica"]
    for n in range(3):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"on {n}"}]
        home, _ = turn(proxy_a, key, messages)
        messages.append({"role": "user", "content": "and then?"})
        follow, cached = turn(proxy_b, key, messages)  # B never saw this conversation
        assert follow["replica"] == home["replica"]
        assert cached > system_tokens  # the conversation's own blocks, not only the system's


def test_readiness_admin_and_cli_name_each_replicas_pool(pair: tuple[Proxy, Proxy, str]) -> None:
    """/readyz keeps its fields and adds the pools; the admin list and the CLI table say them."""
    proxy, _, _ = pair
    status, ready = get(proxy.url + "/readyz")
    assert status == 200
    assert ready["ready"] is True and ready["redis"] is True
    assert ready["replicas"] == {"r1": True, "r2": True, "r3": True}
    assert ready["pools"] == {"r1": "production", "r2": "production", "r3": "eval"}
    assert ready["production_ready"] is True
    status, listed = get(proxy.url + "/admin/replicas", Authorization=f"Bearer {TOKEN}")
    assert status == 200
    assert {r["id"]: r["pool"] for r in listed["replicas"]} == ready["pools"]
    env = {**os.environ, "KVL_URL": proxy.url, "KVL_ADMIN_TOKEN": TOKEN}
    table = subprocess.run(
        [sys.executable, "-m", "router.cli", "replicas", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[-1] == "pool"
    assert sorted((row.split()[0], row.split()[-1]) for row in rows) == [
        ("r1", "production"),
        ("r2", "production"),
        ("r3", "eval"),
    ]


def test_production_true_puts_a_reuse_off_replica_in_the_pool(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """An operator may send production traffic to a reuse-off replica by saying so."""
    snippet = config_snippet([replicas["r1"], replicas["r3"]]).replace(
        "production = false", "production = true"
    )
    proxy = ProxyProcess(snippet, redis_server.url, policy="round_robin", admin_token=TOKEN)
    proxy.start()
    try:
        key = create_key(redis_server.url, "override")
        served = {
            turn(proxy, key, [{"role": "user", "content": f"hi {n}"}])[0]["replica"]
            for n in range(4)
        }
        assert served == {"r1", "r3"}
        assert get(proxy.url + "/readyz")[1]["pools"] == {"r1": "production", "r3": "production"}
    finally:
        proxy.stop()


def test_eval_leases_leave_the_minimum_to_the_production_pool(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """With r3 eval-only, a second shared arm may not take r2 from production: the free r3 does
    not count towards min_production_replicas."""
    proxy = Proxy([replicas["r1"], replicas["r2"], replicas["r3"]], redis_server.url)
    proxy.start()
    try:
        first = sdk(proxy, proxy.create_key("arm-one", mode="eval", cache="shared"))
        first.completions.create(model="ensemble", prompt="leasing", max_tokens=2)
        second = sdk(proxy, proxy.create_key("arm-two", mode="eval", cache="shared"))
        with pytest.raises(openai.APIStatusError) as refused:
            second.completions.create(model="ensemble", prompt="leasing", max_tokens=2)
        assert refused.value.status_code == 503
        assert "would leave 0 replica(s) to production (minimum 1)" in str(refused.value)
    finally:
        proxy.stop()
