"""A proxy with its own Redis for the admin API and CLI tests, and how they talk to it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest
import urllib3

from backends.sim.launcher import Replica
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
