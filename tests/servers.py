"""Real servers for the tests: a private ``redis-server`` that a test may stop and restart, its
replica, and a local Redis Cluster (3 masters, 1 replica each) of real ``redis-server``s."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from router.cli.cluster import ClusterNode, LocalCluster, free_ports
from router.cli.local import LocalError, RedisServer

__all__ = ["ClusterNode", "LocalCluster", "RedisReplica", "RedisServer"]


class RedisReplica:
    """A ``redis-server --replicaof`` the master on ``master_port``; started in sync with it."""

    def __init__(self, master_port: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise LocalError("redis-server is not installed")
        self.binary, self.master_port = binary, master_port
        self.port = free_ports(1)[0]
        self.dir = Path(tempfile.mkdtemp(prefix="kvl-replica-"))
        self.node = ClusterNode(binary, self.port, 0, self.dir, 0)  # for its command()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20) -> None:
        command = [
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--save", ""),
            *("--dir", str(self.dir), "--daemonize", "no"),
            *("--replicaof", "127.0.0.1", str(self.master_port)),
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "master_link_status:up" in self.node.command("INFO", "replication"):
                return
            time.sleep(0.05)
        self.close()
        raise LocalError(f"the replica on port {self.port} did not sync with its master")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)
