"""The admin API of a running proxy: token, keys, replicas, drain, lineage, Redis gone."""

from __future__ import annotations

import time
import uuid

import orjson

from backends.sim.launcher import Replica
from router.ledger.keys import key_hash
from tests.admin_stack import HTTP, Stack, admin, chat, cli, stack, stored
from tests.proxy_harness import Proxy

__all__ = ["stack"]  # the module fixture, used by name


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
