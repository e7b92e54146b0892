"""A second ``kvledger serve`` on a busy port fails at once, and dead proxies leave the registry
(issue 27, item 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from backends.sim.launcher import Replica, config_snippet
from router.cli.local import RedisServer, proxy_config, proxy_env
from tests.proxy_harness import Proxy

PROXIES = "kvl:proxies"


def _entries(client: redis.Redis, port: int) -> list[str]:
    """The registry entries of the proxy on ``port`` (an entry is host:port:pid:random)."""
    return [p.decode() for p in client.hkeys(PROXIES) if f":{port}:" in p.decode()]


def test_a_second_serve_on_a_busy_port_exits_2_in_one_line_touching_nothing(
    tmp_path: Path, redis_server: RedisServer, replicas: dict[str, Replica]
) -> None:
    """The port is checked before the monitor, the registry or the spool: one line, exit 2."""
    first = Proxy(list(replicas.values()), redis_server.url)
    first.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        registry = set(client.hkeys(PROXIES))
        assert registry, "the running proxy registers itself"
        spool = tmp_path / "second-spool.jsonl"
        config = tmp_path / "second.toml"
        snippet = config_snippet(list(replicas.values()))
        config.write_text(proxy_config(first.port, redis_server.url, snippet, spool))
        second = subprocess.run(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            env=proxy_env("admin-secret"),
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{first.port}" in lines[0], lines
        assert "Traceback" not in second.stderr and second.stdout == ""
        assert set(client.hkeys(PROXIES)) == registry, "the second one registered itself"
        assert not spool.exists(), "the second one opened its spool"
    finally:
        client.close()
        first.stop()


def test_a_dead_proxys_registry_entry_expires(
    redis_server: RedisServer, replicas: dict[str, Replica]
) -> None:
    """kill -9 of one proxy: the other's monitor drops its entry within a few intervals."""
    fleet = list(replicas.values())
    doomed, survivor = Proxy(fleet, redis_server.url), Proxy(fleet, redis_server.url)
    doomed.start()
    survivor.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert _entries(client, doomed.port) and _entries(client, survivor.port)
        assert doomed.process is not None
        os.kill(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait()
        deadline = time.monotonic() + 60
        while _entries(client, doomed.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _entries(client, doomed.port) == [], "a dead proxy's entry stayed"
        assert _entries(client, survivor.port), "the living proxy's entry went too"
    finally:
        client.close()
        survivor.stop()
        doomed.stop()
