"""``kvledger replica serve``: one stand-in replica in the foreground, as a container runs it.

The server is a real ``tritonserver`` (from the nvidia-pytriton wheel) started with the
launcher's own helpers (``backend_directory``, ``server_command``, ``server_environment``,
``wait_ready``), on fixed ports and a chosen bind address instead of free loopback ports.
The command waits until the model is ready, prints where the replica listens, passes SIGTERM
and SIGINT on to the server and exits with the server's exit code, so a container runtime
stopping it sees the server stop.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.sim.launcher import Replica


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError("must be a TCP port (1 to 65535)")
    return port


def register(commands: Any) -> None:
    replica = commands.add_parser("replica", help="one stand-in replica (a container's command)")
    actions = replica.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = actions.add_parser(
        "serve",
        help="run one stand-in Triton replica in the foreground on fixed ports until stopped",
    )
    serve.add_argument("--id", required=True, help="the replica's id (names its shm regions)")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    serve.add_argument("--http-port", type=_port, default=8000, help="default 8000")
    serve.add_argument("--grpc-port", type=_port, default=8001, help="default 8001")
    serve.add_argument("--metrics-port", type=_port, default=8002, help="default 8002")
    serve.add_argument(
        "--reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KV-cache block reuse (default on; --no-reuse for cache=off keys)",
    )
    serve.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32", "int4"),
        default="bf16",
        help="weights and stored values: bf16 (default), fp16, fp32 (no 16-bit rounding), int4",
    )
    serve.add_argument("--tokens-per-block", type=int, default=16, help="default 16")
    serve.add_argument(
        "--cache-tokens",
        type=int,
        default=131072,
        help="KV-cache capacity in tokens (max_tokens_in_paged_kv_cache, default 131072)",
    )
    serve.add_argument("--weight-seed", type=int, default=0, help="seed of the random weights")
    serve.add_argument(
        "--workdir", type=Path, help="keep the model repository here (default: a temporary one)"
    )
    serve.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for the model"
    )
    serve.set_defaults(run=run_serve)


def _replica(args: argparse.Namespace, workdir: Path) -> Replica:
    from backends.sim.launcher import Replica, ReplicaSpec
    from backends.sim.repository import ModelSettings

    model = ModelSettings(
        reuse=args.reuse,
        tokens_per_block=args.tokens_per_block,
        max_tokens_in_paged_kv_cache=args.cache_tokens,
        precision=args.precision,
        weight_seed=args.weight_seed,
    )
    ports = (args.http_port, args.grpc_port, args.metrics_port)
    return Replica(ReplicaSpec(args.id, model), *ports, workdir / args.id, host=args.host)


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    root = Path(tempfile.mkdtemp(prefix="kvl-replica-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _Forwarder:
    """Passes SIGTERM and SIGINT on to the server once it runs; remembers that one came."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.received = signum
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)


def _exit_code(returncode: int) -> int:
    # A server killed by a signal exits like a shell reports it: 128 + the signal number.
    return 128 - returncode if returncode < 0 else returncode


def _ports_distinct(args: argparse.Namespace) -> bool:
    return len({args.http_port, args.grpc_port, args.metrics_port}) == 3


def run_serve(args: argparse.Namespace) -> int:
    from backends.sim.launcher import LaunchError, stop, wait_ready

    if not _ports_distinct(args):
        print("kvledger: --http-port, --grpc-port and --metrics-port must differ", file=sys.stderr)
        return 2
    forwarder = _Forwarder()
    with _workdir(args.workdir) as root:
        replica = _replica(args, root)
        try:
            process = _start(replica, root, forwarder)
            wait_ready([replica], args.ready_timeout)
        except (LaunchError, OSError) as exc:
            stop(replica)
            if forwarder.received is not None and replica.process is not None:
                return _exit_code(replica.process.returncode)
            # The server logged why to this command's output; the launcher's log tail is empty.
            print(f"kvledger: {str(exc).rstrip(': ' + chr(10))}", file=sys.stderr)
            return 1
        _print_ready(replica, args)
        try:
            return _exit_code(process.wait())
        finally:
            stop(replica)


def _start(replica: Replica, root: Path, forwarder: _Forwarder) -> subprocess.Popen[bytes]:
    """Write the model repository and start the server with the launcher's command line."""
    from backends.sim.launcher import backend_directory, server_command, server_environment
    from backends.sim.repository import write_repository

    replica.workdir.mkdir(parents=True, exist_ok=True)
    write_repository(replica.workdir, replica.spec.model)
    command = server_command(replica, backend_directory(root / "backends"))
    # The server's output is this command's output: the container's log.
    process = subprocess.Popen(command, env=server_environment(), start_new_session=True)
    replica.process = forwarder.process = process
    if forwarder.received is not None:  # stopped while the repository was being written
        process.send_signal(forwarder.received)
    return process


def _print_ready(replica: Replica, args: argparse.Namespace) -> None:
    model = replica.spec.model
    reuse = "on" if model.reuse else "off"
    print(
        f"replica {replica.id} ready (reuse {reuse}, {model.precision},"
        f" {model.tokens_per_block} tokens per block): bound to {args.host};"
        f" http {replica.http_url}  grpc {replica.grpc_url}  metrics {replica.metrics_url}",
        flush=True,
    )
