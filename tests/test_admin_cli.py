"""The admin API and the ``kvledger keys|lineage|replicas`` commands against a running proxy."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import openai
import orjson
import pytest
import urllib3

from backends.sim.launcher import Replica
from router.ledger.keys import key_hash
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

TOKEN = "admin-secret"  # what tests.proxy_harness gives the proxy
HTTP = urllib3.PoolManager()


@dataclass
class Stack:
    proxy: Proxy
    redis: RedisServer
    ledger: LedgerView


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[Stack]:
    """A proxy in front of r1 and r2 with its own Redis, shared by the module to keep it fast."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis.url)
    proxy.start()
    try:
        yield Stack(proxy, redis, LedgerView(redis.url))
    finally:
        proxy.stop()
        redis.close()


def cli_env(stack: Stack, **extra: str) -> dict[str, str]:
    env = {**os.environ, "KVL_REDIS_URL": stack.redis.url, "KVL_URL": stack.proxy.url}
    env.pop("REDIS_URL", None)
    return {**env, "KVL_ADMIN_TOKEN": TOKEN, **extra}


def cli(stack: Stack, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "router.cli", *args]
    result = subprocess.run(
        command, capture_output=True, text=True, env=cli_env(stack, **env), timeout=60
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def admin(
    stack: Stack, method: str, path: str, body: object = None, token: str | None = TOKEN
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = None if body is None else orjson.dumps(body)
    response = HTTP.request(
        method, stack.proxy.url + path, body=data, headers=headers, retries=False
    )
    return response.status, orjson.loads(response.data)


def chat(stack: Stack, key: str, text: str | None = None) -> str:
    """One chat completion through the proxy; its request id."""
    sdk = openai.OpenAI(base_url=stack.proxy.url + "/v1", api_key=key, max_retries=0)
    raw = sdk.chat.completions.with_raw_response.create(
        model="ensemble",
        max_tokens=2,
        messages=[{"role": "user", "content": text or uuid.uuid4().hex}],
    )
    assert raw.parse().choices
    return str(raw.headers["X-Request-Id"])


def stored(stack: Stack, request_ids: list[str]) -> list[dict[str, Any]]:
    """The requests' lineage records, waiting for the writer that stores them behind the reply."""
    deadline = time.monotonic() + 10
    while True:
        records = [stack.ledger.record(r) for r in request_ids]
        if all(records) or time.monotonic() > deadline:
            assert all(records), request_ids
            return [r for r in records if r is not None]
        time.sleep(0.05)


def test_keys_create_prints_a_working_key(stack: Stack) -> None:
    """`keys create` prints the key alone on stdout, says it is not stored, and the key works."""
    result = cli(stack, "keys", "create", "cli-made", "--mode", "production")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("kvl-") and "\n" not in key
    assert "not stored" in result.stderr
    assert stored(stack, [chat(stack, key)])[0]["key"] == "cli-made"


def test_keys_list_shows_profiles_never_keys(stack: Stack) -> None:
    """`keys list` shows name, mode, cache and creation time, but neither the key nor its hash."""
    key = cli(stack, "keys", "create", "listed", "--mode", "eval", "--cache", "reset").stdout
    key = key.strip()
    table = cli(stack, "keys", "list")
    assert table.returncode == 0, table.stderr
    header = ["name", "mode", "cache", "replica", "created_at"]
    assert table.stdout.splitlines()[0].split() == header
    assert ["listed", "eval", "reset", "-"] == next(
        line.split()[:4] for line in table.stdout.splitlines() if line.startswith("listed ")
    )
    lines = cli(stack, "keys", "list", "--json").stdout
    for output in (table.stdout, lines):
        assert key not in output and key_hash(key) not in output
    profile = next(p for p in map(orjson.loads, lines.splitlines()) if p["name"] == "listed")
    assert datetime.fromisoformat(profile["created_at"]).tzinfo is not None


def test_revoked_key_is_refused_within_the_cache_ttl(stack: Stack) -> None:
    """After `keys revoke`, the same key gets 401 within the proxies' key-cache lifetime."""
    key = cli(stack, "keys", "create", "doomed", "--mode", "production").stdout.strip()
    chat(stack, key)  # the proxy now holds the key in its cache
    result = cli(stack, "keys", "revoke", "doomed")
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 8
    with pytest.raises(openai.AuthenticationError):
        while time.monotonic() < deadline:
            chat(stack, key)
            time.sleep(0.25)
    again = cli(stack, "keys", "revoke", "doomed")
    assert again.returncode == 1 and "no key named 'doomed'" in again.stderr


def test_keys_create_refuses_bad_profiles(stack: Stack) -> None:
    """A bad profile is a one-line usage error naming the flag; a taken name fails with exit 1."""
    bad = cli(stack, "keys", "create", "arm", "--mode", "eval", "--cache", "sometimes")
    assert bad.returncode == 2 and bad.stderr.startswith("kvledger: --cache:")
    assert len(bad.stderr.splitlines()) == 1 and not bad.stdout
    taken = cli(stack, "keys", "create", "cli-made", "--mode", "production")
    assert taken.returncode == 1 and "exists" in taken.stderr and not taken.stdout


def test_admin_api_wants_the_admin_token(stack: Stack) -> None:
    """No token or a wrong one (an API key included) is an OpenAI-shaped 401."""
    key = stack.proxy.create_key("not-admin")
    for token in (None, "wrong", key):
        status, body = admin(stack, "GET", "/admin/keys", token=token)
        assert status == 401, token
        assert body["error"]["type"] == "authentication_error"


def test_admin_api_is_off_without_a_token(stack: Stack, replicas: dict[str, Replica]) -> None:
    """A proxy whose admin-token variable is unset answers every admin call 403, naming it."""
    unset = "KVL_TEST_ADMIN_TOKEN_" + uuid.uuid4().hex
    proxy = Proxy([replicas["r1"]], stack.redis.url, extra=f'admin_token_env = "{unset}"')
    proxy.start()
    try:
        response = HTTP.request("GET", proxy.url + "/admin/keys", headers={"Authorization": "x"})
        error = orjson.loads(response.data)["error"]
        assert response.status == 403 and error["code"] == "admin_disabled"
        assert "admin API disabled" in error["message"] and unset in error["message"]
    finally:
        proxy.stop()


def test_admin_keys_crud(stack: Stack) -> None:
    """POST makes a working key (201, shown once), GET lists it without secrets, DELETE revokes."""
    status, made = admin(stack, "POST", "/admin/keys", {"name": "api-made", "mode": "production"})
    assert status == 201 and made["profile"]["name"] == "api-made"
    chat(stack, made["key"])
    status, listed = admin(stack, "GET", "/admin/keys")
    assert status == 200 and "api-made" in {p["name"] for p in listed["keys"]}
    text = orjson.dumps(listed).decode()
    assert made["key"] not in text and key_hash(made["key"]) not in text
    status, body = admin(stack, "POST", "/admin/keys", {"name": "api-made", "mode": "production"})
    assert status == 409 and body["error"]["code"] == "conflict"
    status, body = admin(stack, "POST", "/admin/keys", {"name": "x", "mode": "staging"})
    assert status == 400 and body["error"]["param"] == "mode"
    assert admin(stack, "DELETE", "/admin/keys/api-made") == (200, {"revoked": "api-made"})
    assert admin(stack, "DELETE", "/admin/keys/api-made")[0] == 404


def test_admin_replicas_list(stack: Stack) -> None:
    """GET /admin/replicas shows r1 and r2 healthy, with their generation and chain head."""
    status, body = admin(stack, "GET", "/admin/replicas")
    assert status == 200 and body["redis"] is True
    replicas = {r["id"]: r for r in body["replicas"]}
    assert set(replicas) == {"r1", "r2"}
    for replica in replicas.values():
        assert replica["healthy"] and not replica["draining"] and replica["generation"] >= 1
        assert isinstance(replica["seq"], int) and len(replica["state"]) == 40


def test_drain_steers_production_traffic(stack: Stack) -> None:
    """`replicas drain r1` keeps production traffic off r1; `replicas undrain r1` brings it back."""
    key = stack.proxy.create_key("drainer")
    try:
        result = cli(stack, "replicas", "drain", "r1")
        assert result.returncode == 0 and "r1: draining" in result.stdout, result.stderr
        listed = cli(stack, "replicas", "list", "--json")
        assert {"r1": True, "r2": False} == {
            r["id"]: r["draining"] for r in map(orjson.loads, listed.stdout.splitlines())
        }
        records = stored(stack, [chat(stack, key) for _ in range(8)])
        assert {r["replica"] for r in records} == {"r2"}
        assert cli(stack, "replicas", "undrain", "r1").returncode == 0
        served = {stored(stack, [chat(stack, key)])[0]["replica"] for _ in range(24)}
        assert "r1" in served
    finally:
        admin(stack, "POST", "/admin/replicas/r1/undrain")
    assert admin(stack, "POST", "/admin/replicas/r9/drain")[0] == 404


def test_replicas_cli_table_and_errors(stack: Stack) -> None:
    """Bare `replicas` prints the table; a wrong token or no proxy is one line and exit 1."""
    table = cli(stack, "replicas")
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["id", "healthy", "draining", "lease"]
    assert sorted(row.split()[:3] for row in rows) == [["r1", "yes", "no"], ["r2", "yes", "no"]]
    wrong = cli(stack, "replicas", "list", KVL_ADMIN_TOKEN="wrong")
    assert wrong.returncode == 1 and "401" in wrong.stderr
    away = cli(stack, "replicas", "list", "--url", "http://127.0.0.1:9")
    assert away.returncode == 1 and "not reachable" in away.stderr
    for result in (wrong, away):
        assert len(result.stderr.splitlines()) == 1 and not result.stdout


def test_lineage_show_and_tail(stack: Stack) -> None:
    """`lineage show` prints a request's record; `lineage tail --key` lists that key's requests."""
    key = stack.proxy.create_key("lineage-cli")
    records = stored(stack, [chat(stack, key) for _ in range(3)])
    ids = [r["request_id"] for r in records]
    shown = cli(stack, "lineage", "show", ids[0])
    assert shown.returncode == 0 and orjson.loads(shown.stdout) == records[0]
    tail = cli(stack, "lineage", "tail", "--key", "lineage-cli", "--json")
    assert tail.returncode == 0, tail.stderr
    lines = tail.stdout.splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == ids
    table = cli(stack, "lineage", "tail", "--key", "lineage-cli", "--count", "2")
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["request_id", "at", "key"]
    assert [row.split()[0] for row in rows] == ids[1:]
    assert records[2]["state_before"][:12] in rows[1].split()
    other_run = cli(stack, "lineage", "tail", "--key", "lineage-cli", "--run", "nosuch", "--json")
    assert other_run.returncode == 0 and not other_run.stdout
    missing = cli(stack, "lineage", "show", "no-such-request")
    assert missing.returncode == 1 and "no lineage record" in missing.stderr


def test_lineage_tail_follow(stack: Stack) -> None:
    """`lineage tail --follow` prints requests as they happen and ends quietly on Ctrl-C."""
    key = stack.proxy.create_key("follower")
    command = [sys.executable, "-m", "router.cli", "lineage", "tail", "--follow", "--json"]
    process = subprocess.Popen(
        [*command, "--key", "follower"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(stack),
    )
    try:
        time.sleep(1)  # let it take its first look (nothing yet) before the request
        request_id = chat(stack, key)
        assert process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(timeout=15), "no line within 15 s"
        assert orjson.loads(process.stdout.readline())["request_id"] == request_id
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=10)
        assert process.returncode == 0 and "Traceback" not in stderr
    finally:
        process.kill()


def test_admin_lineage_and_generations(stack: Stack) -> None:
    """The admin API returns a record by id, the tail by key (newest last) and generations."""
    key = stack.proxy.create_key("lineage-api")
    records = stored(stack, [chat(stack, key) for _ in range(3)])
    assert admin(stack, "GET", f"/admin/lineage/{records[0]['request_id']}") == (200, records[0])
    status, body = admin(stack, "GET", "/admin/lineage?key=lineage-api&count=2")
    assert status == 200 and body["records"] == records[1:]
    assert admin(stack, "GET", "/admin/lineage/nope")[0] == 404
    for query in ("count=0", "count=x", "replcia=r1"):
        assert admin(stack, "GET", f"/admin/lineage?{query}")[0] == 400, query
    status, body = admin(stack, "GET", "/admin/generations?replica=r1")
    assert status == 200 and body["generations"]
    assert {g["replica"] for g in body["generations"]} == {"r1"}
    assert body["generations"][-1]["generation"] >= 1


def test_admin_without_redis(stack: Stack) -> None:
    """With Redis down, admin reads answer 503, and the replica list still shows the local view."""
    stack.redis.stop()
    try:
        for path in ("/admin/keys", "/admin/lineage", "/admin/generations"):
            status, body = admin(stack, "GET", path)
            assert status == 503 and "Redis is unreachable" in body["error"]["message"], path
        status, body = admin(stack, "GET", "/admin/replicas")
        assert status == 200 and body["redis"] is False
        assert {(r["id"], r["healthy"], r["seq"]) for r in body["replicas"]} == {
            ("r1", True, None),
            ("r2", True, None),
        }
    finally:
        stack.redis.start()
    deadline = time.monotonic() + 10
    while admin(stack, "GET", "/admin/replicas")[1]["redis"] is False:
        assert time.monotonic() < deadline, "the proxy did not find Redis again"
        time.sleep(0.1)
