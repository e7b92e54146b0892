"""``kvledger up``: the whole thing on one machine, for a first look, demos and local evals.

Starts a private ``redis-server`` (unless ``REDIS_URL`` names one), N stand-in replicas (real
``tritonserver`` processes), creates a demo API key, and runs the proxy in front of them; prints
where everything listens and a first request to try; Ctrl-C stops all of it.

The private Redis keeps its data in ``WORKDIR/redis`` with an append-only file (``appendonly
yes``, ``appendfsync everysec``): a Redis killed and restarted (its own command line, same
port and directory) comes back with every record and key. ``WORKDIR/up.json`` remembers what a
start chose (the ports, the demo API key, the admin token, the command line's settings), so
``kvledger up --workdir DIR`` started again on the same DIR finds its ledger, keys and config
again: the same Redis data, the same key (while Redis still holds it), the same token.
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

import orjson

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


STATE = "up.json"


def load_state(workdir: Path) -> dict[str, Any]:
    """What an earlier start on ``workdir`` chose (empty on the first start)."""
    try:
        state = orjson.loads((workdir / STATE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def save_state(workdir: Path, state: dict[str, Any]) -> None:
    """``up.json``, readable by its owner only (it holds the demo key and the admin token),
    replaced atomically."""
    path = workdir / STATE
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(orjson.dumps(state, option=orjson.OPT_INDENT_2))
    os.replace(temporary, path)


@contextlib.contextmanager
def _redis(workdir: Path, state: dict[str, Any]) -> Iterator[str]:
    """``REDIS_URL``'s Redis, or a private durable one in ``workdir/redis`` (on the port an
    earlier start used, when it is free) for as long as we run."""
    url = os.environ.get("REDIS_URL") or os.environ.get("KVL_REDIS_URL")
    if url:
        from router.cli.local import redis_persistence

        persistence = redis_persistence(url)
        if persistence == "none":
            from router.ledger.persistence import WARNING

            print(f"kvledger: warning: {WARNING}", file=sys.stderr, flush=True)
        for name in ("redis_port", "redis_pid", "redis_dir", "redis_command"):
            state.pop(name, None)
        yield url
        return
    from router.cli.local import RedisServer

    data = workdir / "redis"
    data.mkdir(exist_ok=True)
    saved = state.get("redis_port")
    server = RedisServer(
        appendonly=True, workdir=data, port=saved if isinstance(saved, int) else None
    )
    server.start()
    state.update(
        redis_port=server.port,
        redis_pid=server.pid,
        redis_dir=str(data),
        redis_command=server.command,
    )
    try:
        yield server.url
    finally:
        server.close()


def _key(redis_url: str, state: dict[str, Any]) -> tuple[str, bool]:
    """The demo key: an earlier start's, while Redis still holds it, else a new one. True when
    it is new."""
    from router.cli import local

    saved = state.get("api_key")
    if isinstance(saved, str) and local.key_valid(redis_url, saved):
        return saved, False
    return local.create_key(redis_url, "demo", replace=True), True


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


def _banner(port: int, key: str, workdir: Path, redis_url: str, token: str, new: bool) -> str:
    base = f"http://127.0.0.1:{port}"
    where = "shown once" if new else f"the one in {workdir / STATE}"
    return (
        f"\nkvledger is up: {base}  (logs and config in {workdir})\n"
        f"API key ({where}): {key}\n\n"
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

    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="kvledger-up-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    state = load_state(workdir)
    if state:
        print(f"found {workdir / STATE}: its Redis data, key and token again", flush=True)
    total = args.replicas + args.reuse_off
    specs = local.stand_in_specs(total, args.replicas)
    saved_token = state.get("admin_token")
    token = os.environ.get("KVL_ADMIN_TOKEN") or (
        saved_token if isinstance(saved_token, str) else secrets.token_urlsafe(18)
    )
    print(f"starting Redis and {total} stand-in replicas...", flush=True)
    try:
        redis = _redis(workdir, state) if not args.redis_cluster else _cluster(workdir, args)
        with redis as redis_url, launch(specs, workdir=workdir / "replicas") as running:
            key, new = _key(redis_url, state)
            state.update(
                api_key=key,
                admin_token=token,
                port=args.port,
                replicas=args.replicas,
                reuse_off=args.reuse_off,
                redis_url=redis_url,
            )
            save_state(workdir, state)
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
                pid = state.get("redis_pid")
                durable = f" (pid {pid}, append-only file in {state.get('redis_dir')})"
                print(f"  redis: {redis_url}{durable if pid else ''}\n  config: {proxy.config}")
                print(_banner(args.port, key, workdir, redis_url, token, new), flush=True)
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
