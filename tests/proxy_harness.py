"""The proxy as users run it: ``kvledger serve`` in its own process, on a real port."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import redis.asyncio as aioredis

from backends.sim.launcher import Replica, config_snippet, free_ports
from router.ledger_keys import KeyStore, Profile


class Proxy:
    def __init__(
        self,
        replicas: Sequence[Replica],
        redis_url: str,
        *,
        policy: str = "prefix_affinity",
        extra: str = "",
        monitor_interval_s: float = 0.5,
    ) -> None:
        self.port = free_ports(1)[0]
        self.dir = Path(tempfile.mkdtemp(prefix="kvl-proxy-"))
        self.redis_url = redis_url
        self.config = self.dir / "kvledger.toml"
        self.config.write_text(
            f'[server]\nport = {self.port}\nredis_url = "{redis_url}"\n'
            f"monitor_interval_s = {monitor_interval_s}\n{extra}\n"
            f'[routing]\npolicy = "{policy}"\n\n'
            f'[lineage]\nspool_path = "{self.dir / "spool.jsonl"}"\n\n' + config_snippet(replicas)
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return (self.dir / "proxy.log").read_text(errors="replace")

    def start(self, timeout: float = 30) -> None:
        env = {**os.environ, "KVL_ADMIN_TOKEN": "admin-secret"}
        env.pop("REDIS_URL", None)
        env.pop("KVL_REDIS_URL", None)
        log = (self.dir / "proxy.log").open("ab")
        command = [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config)]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited {self.process.returncode}:\n{self.log[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError("proxy not ready:\n" + self.log[-3000:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def create_key(self, name: str, **profile: object) -> str:
        async def create() -> str:
            client = aioredis.Redis.from_url(self.redis_url)
            try:
                return await KeyStore(client).create(Profile(name=name, **profile))  # type: ignore[arg-type]
            finally:
                await client.aclose()

        return asyncio.run(create())
