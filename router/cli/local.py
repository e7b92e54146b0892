"""Local processes: a private ``redis-server`` and a ``kvledger serve`` process on loopback.

One small harness for ``kvledger up``, the tests and the benchmarks, so all three start the
proxy exactly as a user does: its own process, a TOML config, a real port, ``/readyz``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.sim.launcher import Replica, ReplicaSpec, free_ports
from backends.sim.repository import ModelSettings


class LocalError(RuntimeError):
    """A local process did not start; the message says which and why."""


class RedisServer:
    """A ``redis-server`` on a free loopback port with its own directory; restartable in place."""

    def __init__(
        self, *, appendonly: bool = True, workdir: Path | None = None, port: int | None = None
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise LocalError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.appendonly = appendonly
        self.port = port if port is not None and port_free(port) else free_ports(1)[0]
        self._own_dir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="kvl-redis-")) if workdir is None else workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def command(self) -> list[str]:
        """Its command line (redis-server rewrites its process title: /proc shows not this)."""
        return [
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "yes" if self.appendonly else "no"),
            *(("--appendfsync", "everysec") if self.appendonly else ()),
            *("--dir", str(self.dir), "--daemonize", "no"),
        ]

    def start(self, timeout_s: float = 10) -> None:
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise LocalError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        elif self.process is not None:
            self.process.wait()
        self.process = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on loopback now."""
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


def proxy_config(
    port: int,
    redis_url: str,
    replicas_toml: str,
    spool: Path,
    *,
    policy: str = "prefix_affinity",
    monitor_interval_s: float | None = None,
    extra: str = "",
) -> str:
    """A proxy config: ``[server]`` (``extra`` lines go there too), routing, spool, replicas."""
    server = f'host = "127.0.0.1"\nport = {port}\nredis_url = "{redis_url}"\n'
    if monitor_interval_s is not None:
        server += f"monitor_interval_s = {monitor_interval_s}\n"
    return (
        f"[server]\n{server}{extra}\n\n"
        f'[routing]\npolicy = "{policy}"\n\n'
        f'[lineage]\nspool_path = "{spool}"\n\n{replicas_toml}'
    )


class ProxyProcess:
    """``kvledger serve`` in its own process, with a config written into ``workdir``
    (``kvledger.toml``, ``proxy.log``, ``spool.jsonl``); ``replicas_toml`` names the replicas.
    ``ProxyProcess.recent`` holds the last ones started (the tests show their logs when a test
    fails)."""

    recent: deque[ProxyProcess] = deque(maxlen=16)

    def __init__(
        self,
        replicas_toml: str,
        redis_url: str,
        *,
        port: int | None = None,
        workdir: Path | None = None,
        policy: str = "prefix_affinity",
        monitor_interval_s: float | None = None,
        extra: str = "",
        admin_token: str = "admin-secret",
    ) -> None:
        self.port = free_ports(1)[0] if port is None else port
        self.dir = Path(tempfile.mkdtemp(prefix="kvl-proxy-")) if workdir is None else workdir
        self.redis_url = redis_url
        self.admin_token = admin_token
        self.config = self.dir / "kvledger.toml"
        self.log_path = self.dir / "proxy.log"
        spool = self.dir / "spool.jsonl"
        self.config.write_text(
            proxy_config(
                self.port,
                redis_url,
                replicas_toml,
                spool,
                policy=policy,
                monitor_interval_s=monitor_interval_s,
                extra=extra,
            )
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self, timeout_s: float = 60, python: list[str] | None = None) -> None:
        """Start it and wait until ``/readyz`` answers; LocalError with the log's tail if not.
        ``python``: the interpreter's command line (a profiler's wrapper), this one's if None."""
        command = [*(python or [sys.executable]), "-m", "router.cli", "serve"]
        command += ["--config", str(self.config)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=proxy_env(self.admin_token)
            )
        ProxyProcess.recent.append(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LocalError(
                    f"the proxy exited with {self.process.returncode}:\n{self.log[-3000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()  # a caller that gets the error has no process to stop
        raise LocalError("the proxy did not become ready:\n" + self.log[-3000:])

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM and wait; a proxy that does not exit in time is killed, then reported."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise LocalError(
                    f"the proxy did not exit within {timeout_s:g} s of SIGTERM (killed):\n"
                    + self.log[-3000:]
                ) from None


def create_key(redis_url: str, name: str, *, replace: bool = False, **profile: Any) -> str:
    """A new API key for ``name`` straight in Redis (``replace`` revokes an existing one)."""
    from router.ledger.connect import connect
    from router.ledger.keys import KeyStore, Profile

    async def create() -> str:
        client = connect(redis_url, timeout_s=5, connect_timeout_s=5)
        try:
            store = KeyStore(client)
            if replace:
                await store.revoke(name)
            return await store.create(Profile(name=name, **profile))
        finally:
            await client.aclose()

    return asyncio.run(create())


def key_valid(redis_url: str, key: str) -> bool:
    """Whether ``key`` is an API key the Redis at ``redis_url`` holds."""
    from router.ledger.connect import connect
    from router.ledger.keys import KeyStore

    async def lookup() -> bool:
        client = connect(redis_url, timeout_s=5, connect_timeout_s=5)
        try:
            return await KeyStore(client).lookup(key) is not None
        finally:
            await client.aclose()

    return asyncio.run(lookup())


def redis_persistence(redis_url: str) -> str:
    """What the Redis at ``redis_url`` does to keep its data (``router.ledger.persistence``)."""
    from router.ledger.connect import connect
    from router.ledger.persistence import redis_persistence as read

    async def check() -> str:
        client = connect(redis_url, timeout_s=5, connect_timeout_s=5)
        try:
            return await read(client)
        finally:
            await client.aclose()

    return asyncio.run(check())


def wait_for_signal(alive: Callable[[], bool] = lambda: True) -> None:
    """Block until SIGINT or SIGTERM (Ctrl-C, or a supervisor stopping us), or until ``alive``
    says what we hold has gone."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5) and alive():
        pass


def stand_in_specs(total: int, reuse_on: int, prefix: str = "r", **model: Any) -> list[ReplicaSpec]:
    """``total`` stand-in replicas ``PREFIX1..N``; the first ``reuse_on`` reuse KV blocks."""
    return [
        ReplicaSpec(f"{prefix}{i + 1}", ModelSettings(reuse=i < reuse_on, **model))
        for i in range(total)
    ]


def describe(replica: Replica) -> str:
    """One line: where a stand-in replica listens and what it is."""
    model = replica.spec.model
    return (
        f"  {replica.id}: http {replica.http_url}  grpc {replica.grpc_url}"
        f"  metrics {replica.metrics_url}  (reuse {'on' if model.reuse else 'off'},"
        f" {model.precision})"
    )


def proxy_env(admin_token: str) -> dict[str, str]:
    """This environment for a proxy process, with its admin token and no Redis override."""
    env = {**os.environ, "KVL_ADMIN_TOKEN": admin_token}
    env.pop("REDIS_URL", None)
    env.pop("KVL_REDIS_URL", None)
    return env
