"""The processes the overhead benchmark measures: the trivial Triton model, nginx, the bare
aiohttp pass-through, and kvledger (one process per replica transport), with their pids for
CPU accounting from /proc."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from backends.sim.launcher import (
    Replica,
    ReplicaSpec,
    backend_directory,
    free_ports,
    server_command,
    server_environment,
    stop,
    wait_ready,
)
from bench.overhead_model import MODEL, write_repository
from router.cli.local import ProxyProcess

ROOT = Path(__file__).resolve().parents[1]
GENERATE = f"/v2/models/{MODEL}/generate"
COMPLETIONS = "/v1/completions"


@dataclass
class Target:
    """One thing the client talks to: where, how, and which processes do its work."""

    name: str
    base: str
    path: str  # the non-streamed path; streams add "_stream" (generate) or "stream": true
    pids: list[int] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    kvledger: bool = False

    @property
    def openai(self) -> bool:
        return self.path == COMPLETIONS


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes and their children, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _with_children(pids):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _with_children(pids: list[int]) -> list[int]:
    found = list(pids)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid in pids:
                found.append(int(entry.name))
    return found


@contextlib.contextmanager
def trivial_triton(root: Path) -> Iterator[Replica]:
    """A real tritonserver serving the trivial model, ready; stopped on exit."""
    backends = backend_directory(root / "backends")
    http, grpc, metrics = free_ports(3)
    replica = Replica(ReplicaSpec("trivial"), http, grpc, metrics, root / "trivial")
    write_repository(replica.workdir / "models")
    with replica.log_path.open("ab") as log:
        replica.process = subprocess.Popen(
            server_command(replica, backends),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_environment(),
            start_new_session=True,
        )
    try:
        wait_ready([replica])
        yield replica
    finally:
        stop(replica)


def replica_toml(replica: Replica, transport: str | None) -> str:
    """The trivial model is its own engine model: it has no ``tensorrt_llm`` behind it."""
    line = f'transport = "{transport}"\n' if transport else ""
    return (
        f'[[replicas]]\nid = "{replica.id}"\ngrpc = "{replica.grpc_url}"\n'
        f'http = "{replica.http_url}"\nmetrics = "{replica.metrics_url}"\n'
        f'model = "{MODEL}"\nengine_model = "{MODEL}"\n{line}'
    )


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (a 404 or 405 is an answer)
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


@contextlib.contextmanager
def passthrough(upstream: str, python: list[str] | None = None) -> Iterator[Target]:
    """The bare pass-through; ``python``: the interpreter's command line (a profiler's
    wrapper, which starts and stops slowly), this one's if None."""
    port = free_ports(1)[0]
    command = [*(python or [sys.executable]), "-m", "bench.overhead_passthrough"]
    command += ["--port", str(port), "--upstream", upstream]
    process = subprocess.Popen(command, cwd=ROOT)
    slow = 60 if python else 1
    try:
        wait_http(f"http://127.0.0.1:{port}/", process, timeout_s=30 * slow)
        yield Target("aiohttp pass-through", f"http://127.0.0.1:{port}", GENERATE, [process.pid])
    finally:
        process.terminate()
        process.wait(timeout=10 * slow)


@contextlib.contextmanager
def plumbing(upstream: str, redis_port: int, python: list[str] | None = None) -> Iterator[Target]:
    """kvledger's plumbing alone (``bench/overhead_plumbing.py``); ``python``: as for
    :func:`passthrough`."""
    port = free_ports(1)[0]
    command = [*(python or [sys.executable]), "-m", "bench.overhead_plumbing"]
    command += ["--port", str(port), "--upstream", upstream, "--redis-port", str(redis_port)]
    process = subprocess.Popen([*command, "--model", MODEL], cwd=ROOT)
    slow = 60 if python else 1
    try:
        wait_http(f"http://127.0.0.1:{port}/", process, timeout_s=30 * slow)
        name = "kvledger's plumbing alone"
        yield Target(name, f"http://127.0.0.1:{port}", GENERATE, [process.pid])
    finally:
        process.terminate()
        process.wait(timeout=10 * slow)


NGINX_CONF = """worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream triton {{ server {upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://triton;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx(upstream_hostport: str) -> Iterator[Target | None]:
    """nginx with a keep-alive upstream, or None when it is not installed."""
    # Debian installs it in /usr/sbin, which a non-root PATH may lack.
    binary = shutil.which("nginx", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    if binary is None:
        yield None
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvl-nginx-"))
    port = free_ports(1)[0]
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, upstream=upstream_hostport, port=port))
    process = subprocess.Popen(
        [binary, "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/health/live", process)
        yield Target("nginx", f"http://127.0.0.1:{port}", GENERATE, [process.pid])
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def kvledger(
    replica: Replica, redis_url: str, transport: str | None, python: list[str] | None = None
) -> Iterator[ProxyProcess]:
    """``kvledger serve`` in front of the replica, ledger on, as a user starts it (``python``:
    as for :func:`passthrough`)."""
    proxy = ProxyProcess(replica_toml(replica, transport), redis_url)
    slow = 10 if python else 1
    proxy.start(timeout_s=60 * slow, python=python)
    try:
        yield proxy
    finally:
        proxy.stop(timeout_s=30 * slow)
