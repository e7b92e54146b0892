"""``kvledger up``: the whole thing on one machine, for a first look and for demos.

Starts a private ``redis-server`` (unless ``REDIS_URL`` names one), N stand-in replicas (real
``tritonserver`` processes), creates a demo API key, and runs the proxy in front of them; prints
where everything listens and a first request to try; Ctrl-C stops all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    up = commands.add_parser("up", help="run Redis, stand-in replicas and the proxy together")
    up.add_argument(
        "--replicas", type=int, default=2, help="stand-in replicas with block reuse (default 2)"
    )
    up.add_argument(
        "--reuse-off",
        type=int,
        default=1,
        metavar="K",
        help="and K more with block reuse disabled, for cache=off eval keys (default 1)",
    )
    up.add_argument("--port", type=int, default=8000, help="the proxy's port (default 8000)")
    up.add_argument("--workdir", type=Path, help="keep config, logs and spool here")
    up.set_defaults(run=run_up)


@contextlib.contextmanager
def _redis(workdir: Path) -> Iterator[str]:
    url = os.environ.get("REDIS_URL") or os.environ.get("KVL_REDIS_URL")
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("kvledger: redis-server not found; install it or set REDIS_URL")
    from backends.sim.launcher import free_ports

    port = free_ports(1)[0]
    args = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _config(workdir: Path, redis_url: str, port: int, snippet: str) -> Path:
    path = workdir / "kvledger.toml"
    path.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nredis_url = "{redis_url}"\n\n'
        '[routing]\npolicy = "prefix_affinity"\n\n'
        f'[lineage]\nspool_path = "{workdir / "spool.jsonl"}"\n\n{snippet}'
    )
    return path


async def _demo_key(redis_url: str) -> str:
    import redis.asyncio as aioredis

    from router.ledger_keys import KeyStore, Profile

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = KeyStore(client)
        await store.revoke("demo")
        return await store.create(Profile(name="demo"))
    finally:
        await client.aclose()


def _wait_ready(port: int, proxy: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.poll() is not None:
            raise SystemExit(f"kvledger: the proxy exited with {proxy.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                return
        time.sleep(0.2)
    raise SystemExit("kvledger: the proxy did not become ready")


def _banner(port: int, key: str, workdir: Path, redis_url: str, token: str) -> str:
    base = f"http://127.0.0.1:{port}"
    return (
        f"\nkvledger is up: {base}  (logs and config in {workdir})\n"
        f"API key (shown once): {key}\n\n"
        "For the kvledger commands (keys, runs, lineage, replicas), in another shell:\n"
        f"  export KVL_URL={base} KVL_REDIS_URL={redis_url} KVL_ADMIN_TOKEN={token}\n\n"
        "Try:\n"
        f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {key}' \\\n"
        "    -H 'Content-Type: application/json' \\\n"
        '    -d \'{"model": "ensemble", "max_tokens": 16, '
        '"messages": [{"role": "user", "content": "Hello!"}]}\' | python3 -m json.tool\n'
        f"  curl -si {base}/v2/models/ensemble/generate -H 'Authorization: Bearer {key}' "
        '-d \'{"text_input": "Hello!", "max_tokens": 8}\'\n'
        "  kvledger lineage tail\n"
        "  kvledger keys create my-arm --mode eval --cache reset   # an eval arm; see README\n\n"
        "Ctrl-C stops everything.\n"
    )


def run_up(args: argparse.Namespace) -> int:
    from backends.sim.launcher import ReplicaSpec, config_snippet, launch

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvledger-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from backends.sim.repository import ModelSettings

    total = args.replicas + args.reuse_off
    specs = [ReplicaSpec(f"r{i + 1}", ModelSettings(reuse=i < args.replicas)) for i in range(total)]
    token = os.environ.get("KVL_ADMIN_TOKEN") or secrets.token_urlsafe(18)
    print(f"starting Redis and {total} stand-in replicas...", flush=True)
    with _redis(workdir) as redis_url, launch(specs, workdir=workdir / "replicas") as replicas:
        config = _config(workdir, redis_url, args.port, config_snippet(replicas))
        key = asyncio.run(_demo_key(redis_url))
        log = (workdir / "proxy.log").open("ab")
        command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
        env = {**os.environ, "KVL_ADMIN_TOKEN": token}
        proxy = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(args.port, proxy)
            for r in replicas:
                reuse = "on" if r.spec.model.reuse else "off"
                print(
                    f"  replica {r.id}: grpc {r.grpc_url}  metrics {r.metrics_url}  reuse {reuse}"
                )
            print(f"  redis: {redis_url}\n  config: {config}")
            print(_banner(args.port, key, workdir, redis_url, token), flush=True)
            while not stop.is_set() and proxy.poll() is None:
                stop.wait(0.5)
        finally:
            print("stopping...", flush=True)
            proxy.terminate()
            proxy.wait(timeout=30)
    return 0
