"""Start stand-in replicas: real ``tritonserver`` processes from the nvidia-pytriton wheel.

Each replica is one Triton server (its own loopback ports, its own shared-memory prefix, its own
model repository, engine and tokenizer: :mod:`backends.sim.repository`) started with
``--model-control-mode=explicit`` and only the ``ensemble`` model named, so Triton loads its
composing models as dependents and resets are real unload and load calls, as on a GPU fleet.
Stopping a replica empties its whole process group: no Python-backend stub outlives its server.

Used by the ``kvledger replicas up`` command, the README's demo and the tests::

    with launch([ReplicaSpec("r1"), ReplicaSpec("r2", ModelSettings(reuse=False))]) as replicas:
        print(replicas[0].http_url)
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backends.sim.repository import (
    ENGINE_MODEL,
    MODEL_NAME,
    ModelSettings,
    engine_dir,
    write_repository,
)

_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class LaunchError(RuntimeError):
    """A replica did not come up; the message carries the tail of its log."""


@dataclass(frozen=True)
class ReplicaSpec:
    id: str
    model: ModelSettings = field(default_factory=ModelSettings)


@dataclass
class Replica:
    """A running stand-in replica and where it listens."""

    spec: ReplicaSpec
    http_port: int
    grpc_port: int
    metrics_port: int
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"  # the address the server binds

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def reach(self) -> str:
        """Where this machine reaches the server (a wildcard bind means loopback)."""
        host = _WILDCARDS.get(self.host, self.host)
        return f"[{host}]" if ":" in host else host

    @property
    def http_url(self) -> str:
        return f"http://{self.reach}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.reach}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.reach}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        return self.workdir / "tritonserver.log"

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def pytriton_dir() -> Path:
    """Where the nvidia-pytriton wheel keeps ``tritonserver`` and the Python backend."""
    try:
        import pytriton
    except ImportError as exc:
        raise LaunchError(
            "the stand-in replica needs the 'sim' extra: pip install -e '.[sim]'"
        ) from exc
    return Path(pytriton.__file__).resolve().parent / "tritonserver"


def backend_directory(root: Path) -> Path:
    """A ``--backend-directory`` whose ``python/`` has the backend and the stub for this Python."""
    wheel = pytriton_dir()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise LaunchError(f"nvidia-pytriton ships no Python-backend stub for Python {version}")
    target = root / "python"
    target.mkdir(parents=True, exist_ok=True)
    for source in (
        wheel / "backends" / "python" / "libtriton_python.so",
        wheel / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        link = target / source.name
        if not link.exists():
            link.symlink_to(source)
    return root


def server_environment() -> dict[str, str]:
    """The stub must load this interpreter's libpython and find this venv's packages."""
    env = dict(os.environ)
    libs = [
        str(sysconfig.get_config_var("LIBDIR")),
        str(pytriton_dir().parent.parent / "nvidia_pytriton.libs"),
    ]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = ":".join(p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    # The engine is single-threaded by design; BLAS threads would only fight the proxy for cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def free_ports(count: int) -> list[int]:
    """Ports the kernel says are free now (held open together so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def server_command(replica: Replica, backends: Path) -> list[str]:
    """The ``tritonserver`` command line for one replica."""
    binary = pytriton_dir() / "bin" / "tritonserver"
    prefix = f"kvl_{replica.id}_{os.getpid()}_{replica.http_port}_"
    return [
        str(binary),
        f"--model-repository={replica.workdir / 'models'}",
        f"--backend-directory={backends}",
        f"--backend-config=python,shm-region-prefix-name={prefix}",
        "--model-control-mode=explicit",
        f"--load-model={MODEL_NAME}",
        f"--http-port={replica.http_port}",
        f"--grpc-port={replica.grpc_port}",
        f"--metrics-port={replica.metrics_port}",
        f"--http-address={replica.host}",
        f"--grpc-address={replica.host}",
        f"--metrics-address={replica.host}",
        "--allow-metrics=true",
        "--metrics-interval-ms=500",
        "--exit-on-error=true",
        "--log-verbose=0",
    ]


def start(
    spec: ReplicaSpec, root: Path, backends: Path, ports: Sequence[int] | None = None
) -> Replica:
    """Start one replica's server (without waiting for it to be ready) on ``ports`` (HTTP,
    gRPC, metrics), or on three ports free now."""
    http_port, grpc_port, metrics_port = ports if ports is not None else free_ports(3)
    workdir = root / spec.id
    workdir.mkdir(parents=True, exist_ok=True)
    replica = Replica(spec, http_port, grpc_port, metrics_port, workdir)
    write_repository(workdir, spec.model)
    log = replica.log_path.open("ab")
    replica.process = subprocess.Popen(
        server_command(replica, backends),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=server_environment(),
        start_new_session=True,
    )
    log.close()
    return replica


def is_ready(replica: Replica) -> bool:
    """Server live and the ``ensemble`` model ready, through Triton's HTTP health API."""
    url = f"{replica.http_url}/v2/models/{MODEL_NAME}/ready"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False  # not up yet, or something else answers on the port (not our server)


def wait_ready(replicas: Sequence[Replica], timeout: float = 120.0) -> None:
    """Block until every replica serves its model, or raise with the failing one's log."""
    deadline = time.monotonic() + timeout
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.process is not None and replica.process.poll() is not None:
                raise LaunchError(
                    f"replica {replica.id} exited with {replica.process.returncode}:\n"
                    + replica.log_tail()
                )
            if is_ready(replica):
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            raise LaunchError(f"replica {pending[0].id} not ready in {timeout:.0f}s")
        if pending:
            time.sleep(0.2)


def stop(replica: Replica, timeout: float = 20.0) -> None:
    """Stop the replica's server and every process of its group (see :func:`stop_all`)."""
    stop_all([replica], timeout)


def stop_all(replicas: Sequence[Replica], timeout: float = 20.0) -> None:
    """SIGTERM every server (Triton unloads its models and exits), then wait; then make sure each
    server's process group is empty. The Python-backend stubs are in that group: a server killed
    with SIGKILL leaves them behind, orphaned and busy-waiting on their shared memory, so a group
    with anything left gets SIGTERM, then SIGKILL. Shutdowns overlap instead of queueing."""
    processes = [r.process for r in replicas if r.process is not None]
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        _reap(process, max(0.1, deadline - time.monotonic()))


def _reap(process: subprocess.Popen[bytes], timeout: float) -> None:
    group = process.pid  # started with start_new_session: the server leads its own group
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(group, signal.SIGKILL)
        process.wait(timeout=10)
    if _group_alive(group):
        _kill_group(group, signal.SIGTERM)
        end = time.monotonic() + 5
        while _group_alive(group) and time.monotonic() < end:
            time.sleep(0.05)
        _kill_group(group, signal.SIGKILL)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group is not ours to signal: it exists
        return True
    return True


def _kill_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


@contextlib.contextmanager
def launch(
    specs: Sequence[ReplicaSpec], workdir: Path | None = None, timeout: float = 120.0
) -> Iterator[list[Replica]]:
    """Start the replicas, wait until all are ready, yield them, and stop them all on exit."""
    root = Path(tempfile.mkdtemp(prefix="kvl-replicas-")) if workdir is None else workdir
    replicas: list[Replica] = []
    try:
        backends = backend_directory(root / "backends")
        # Every replica's ports in one call: ports asked for one replica at a time may repeat
        # (the kernel hands a port out again until the server that was given it binds it),
        # and a replica's HTTP port would then be another's gRPC port.
        ports = free_ports(3 * len(specs))
        replicas.extend(
            start(spec, root, backends, ports[3 * i : 3 * i + 3]) for i, spec in enumerate(specs)
        )
        wait_ready(replicas, timeout)
        yield replicas
    finally:
        stop_all(replicas)
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _pool_line(reuse: bool) -> str:
    # Spelt out although it is the default, so a reader of the config sees why r3 gets no
    # production traffic.
    if reuse:
        return "production = true\n"
    return "production = false    # block reuse off: serves cache=off eval arms only\n"


def config_snippet(replicas: Sequence[Replica]) -> str:
    """TOML the proxy's config reads: one ``[[replicas]]`` table per replica."""
    blocks = []
    for r in replicas:
        blocks.append(
            "[[replicas]]\n"
            f'id = "{r.id}"\n'
            f'grpc = "{r.grpc_url}"\n'
            f'http = "{r.http_url}"\n'
            f'metrics = "{r.metrics_url}"\n'
            f'model = "{MODEL_NAME}"\n'
            f'engine_model = "{ENGINE_MODEL}"\n'
            f'engine_dir = "{engine_dir(r.workdir)}"\n'
            f"reuse = {'true' if r.spec.model.reuse else 'false'}\n"
            f"tokens_per_block = {r.spec.model.tokens_per_block}\n"
            "max_token_bytes = 1\n"  # the stand-in's tokenizer is byte-level
            + _pool_line(r.spec.model.reuse)
        )
    return "\n".join(blocks)
