"""``kvledger up``: the whole thing on one machine, for a first look and for demos.

Starts a private ``redis-server`` (unless ``REDIS_URL`` names one), N stand-in replicas (real
``tritonserver`` processes), creates a demo API key, and runs the proxy in front of them; prints
where everything listens and a first request to try; Ctrl-C stops all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies import DEFAULT_POLICY

if TYPE_CHECKING:
    from backends.sim.launcher import Replica


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
        help="and K more with block reuse disabled, serving cache=off eval keys only (default 1)",
    )
    up.add_argument("--port", type=int, default=8000, help="the proxy's port (default 8000)")
    up.add_argument("--workdir", type=Path, help="keep config, logs and spool here")
    up.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help="a local Redis Cluster instead of one redis-server: N masters (3 or more), "
        "1 replica each (see router/cli/cluster.py)",
    )
    up.set_defaults(run=run_up)


@contextlib.contextmanager
def _redis(workdir: Path) -> Iterator[str]:
    """``REDIS_URL``'s Redis, or a private one in ``workdir`` for as long as we run."""
    url = os.environ.get("REDIS_URL") or os.environ.get("KVL_REDIS_URL")
    if url:
        yield url
        return
    from router.cli.local import RedisServer

    server = RedisServer(appendonly=False, workdir=workdir)
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@contextlib.contextmanager
def _cluster(workdir: Path, args: argparse.Namespace) -> Iterator[str]:
    """A local Redis Cluster in ``workdir`` for as long as we run (its ``redis+cluster://`` URL)."""
    from router.cli.cluster import LocalCluster

    cluster = LocalCluster(args.redis_cluster, 1, workdir=workdir / "redis-cluster")
    cluster.start()
    try:
        yield cluster.url
    finally:
        cluster.close()


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


def _pools(running: Sequence[Replica]) -> str:
    """Which replicas take production traffic: those that reuse blocks (the config default)."""
    production = [r.id for r in running if r.spec.model.reuse]
    eval_only = [r.id for r in running if not r.spec.model.reuse]
    line = f"  production traffic: {', '.join(production)} (routing: {DEFAULT_POLICY})"
    if eval_only:
        line += f"\n  eval only (block reuse off, cache=off arms): {', '.join(eval_only)}"
    return line


def chat_model_toml(running: Sequence[Replica]) -> str:
    """``[models.ensemble]``: the stand-in's chat template (its tokenizer's
    tokenizer_config.json; every replica writes the same one) and its tool-call format."""
    from backends.sim.repository import MODEL_NAME

    tokenizer = running[0].workdir / "tokenizer"
    return f'\n[models.{MODEL_NAME}]\ntokenizer = "{tokenizer}"\ntool_call_parser = "hermes"\n'


def run_up(args: argparse.Namespace) -> int:
    from backends.sim.launcher import LaunchError, config_snippet, launch
    from router.cli import local

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvledger-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    total = args.replicas + args.reuse_off
    specs = local.stand_in_specs(total, args.replicas)
    token = os.environ.get("KVL_ADMIN_TOKEN") or secrets.token_urlsafe(18)
    print(f"starting Redis and {total} stand-in replicas...", flush=True)
    try:
        redis = _redis(workdir) if not args.redis_cluster else _cluster(workdir, args)
        with redis as redis_url, launch(specs, workdir=workdir / "replicas") as running:
            key = local.create_key(redis_url, "demo", replace=True)
            proxy = local.ProxyProcess(
                config_snippet(running),
                redis_url,
                port=args.port,
                workdir=workdir,
                admin_token=token,
                policy=DEFAULT_POLICY,
                extra=chat_model_toml(running),
            )
            try:
                proxy.start()
                print("\n".join(map(local.describe, running)))
                print(_pools(running))
                print(f"  redis: {redis_url}\n  config: {proxy.config}")
                print(_banner(args.port, key, workdir, redis_url, token), flush=True)
                process = proxy.process
                assert process is not None
                local.wait_for_signal(alive=lambda: process.poll() is None)
            finally:
                print("stopping...", flush=True)
                proxy.stop()
    except (LaunchError, local.LocalError) as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return 1
    return 0
