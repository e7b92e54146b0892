"""A local Redis Cluster of real ``redis-server`` processes, for ``kvledger up --redis-cluster N``,
the tests and the benchmarks: N masters with one replica each (or none), on loopback ports.

Each node is ``redis-server --cluster-enabled yes`` in its own directory (append-only file on,
so a restarted node keeps its data); ``redis-cli --cluster create`` assigns the slots evenly,
introduces the nodes and pairs each replica with a master. ``cluster-node-timeout`` (1 s by
default here, 15 s in Redis' own default) is how long a silent master goes before its replica
is promoted: short, so that a failover in a test or a demo takes seconds.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import hiredis

from router.cli.local import LocalError


class ClusterNode:
    """One ``redis-server`` of the cluster; restartable in place (same port, same directory)."""

    def __init__(
        self, binary: str, port: int, bus_port: int, workdir: Path, node_timeout_ms: int
    ) -> None:
        self.binary, self.port, self.bus_port, self.dir = binary, port, bus_port, workdir
        self.node_timeout_ms = node_timeout_ms
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        command = [
            self.binary,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "yes", "--dir", str(self.dir), "--daemonize", "no"),
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-node-timeout", str(self.node_timeout_ms)),
            # Its own bus port (the default, port + 10000, fails above port 55535).
            *("--cluster-port", str(self.bus_port)),
            # A replica of a master that was away long asks to be promoted anyway.
            *("--cluster-replica-validity-factor", "0"),
            *("--cluster-require-full-coverage", "no"),
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.command("PING") == b"PONG":
                return
            time.sleep(0.05)
        self.stop()
        raise LocalError(f"redis-server (cluster node) did not answer on port {self.port}")

    def command(self, *args: str, timeout_s: float = 2.0) -> Any:
        """One command's reply, parsed (bytes, int, lists; an error reply as an exception
        object), or None when the node does not answer."""
        payload = "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        reader = hiredis.Reader()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as s:
                s.sendall(f"*{len(args)}\r\n{payload}".encode())
                while (reply := reader.gets()) is False:
                    data = s.recv(65536)
                    if not data:
                        return None
                    reader.feed(data)
                return reply
        except OSError:
            return None

    def text(self, *args: str) -> str:
        """A command's reply as text ('' when the node does not answer or it is no text)."""
        reply = self.command(*args)
        return reply.decode(errors="replace") if isinstance(reply, bytes) else ""

    def kill(self) -> None:
        """``kill -9``: no goodbye to the cluster, no last write to disk."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on free loopback ports."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        *,
        node_timeout_ms: int = 1000,
        workdir: Path | None = None,
    ) -> None:
        if masters < 3:
            raise LocalError("a Redis Cluster needs at least 3 masters")
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise LocalError("redis-server and redis-cli are not installed (apt-get install redis)")
        self.cli = cli
        self.masters, self.replicas = masters, replicas
        self._own_dir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="kvl-cluster-")) if workdir is None else workdir
        count = masters * (1 + replicas)
        ports = free_ports(2 * count)
        self.nodes = [
            ClusterNode(binary, port, bus, self.dir / str(port), node_timeout_ms)
            for port, bus in zip(ports[:count], ports[count:], strict=True)
        ]

    @property
    def url(self) -> str:
        """The cluster URL (``redis+cluster://`` and every node: any one that answers will do)."""
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def start(self, timeout_s: float = 60) -> None:
        try:
            for node in self.nodes:
                node.start()
            created = subprocess.run(
                [
                    self.cli,
                    "--cluster",
                    "create",
                    *(node.address for node in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            if created.returncode != 0:
                raise LocalError(f"redis-cli --cluster create failed: {created.stdout[-800:]}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.close()
            raise

    def wait_ok(self, timeout_s: float = 60) -> None:
        """Until every running node says ``cluster_state:ok`` and every master's replicas are
        in sync (a WAIT can then be acknowledged)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._settled(node) for node in self.nodes if node.running):
                return
            time.sleep(0.1)
        raise LocalError(f"the cluster did not settle within {timeout_s:g} s")

    def _settled(self, node: ClusterNode) -> bool:
        if "cluster_state:ok" not in node.text("CLUSTER", "INFO"):
            return False
        info = node.text("INFO", "replication")
        if "role:master" in info:
            if not self._has_replicas(node):
                return True
            # In sync, and known as such to the cluster (CLUSTER SLOTS lists its replicas).
            return f"connected_slaves:{self.replicas}" in info and self._listed(node)
        return "master_link_status:up" in info

    def _listed(self, node: ClusterNode) -> bool:
        """True when every running node's CLUSTER SLOTS lists a replica with ``node``'s slots
        (a client's slot map then knows a WAIT there can be acknowledged)."""
        for other in self.nodes:
            if not other.running:
                continue
            ranges = other.command("CLUSTER", "SLOTS")
            if not isinstance(ranges, list):
                return False
            mine = [r for r in ranges if int(r[2][1]) == node.port]
            if not mine or any(len(r) < 4 for r in mine):
                return False
        return True

    def _has_replicas(self, node: ClusterNode) -> bool:
        """False for a master whose replicas are all down (nothing to wait for)."""
        me = node.text("CLUSTER", "MYID").strip()
        for line in node.text("CLUSTER", "NODES").splitlines():
            parts = line.split(" ")
            if len(parts) > 3 and parts[3] == me and "fail" not in parts[2]:
                return True
        return False

    def flushall(self) -> None:
        """Empty every master (their replicas follow)."""
        for node in self.nodes:
            if node.running and "role:master" in node.text("INFO", "replication"):
                node.command("FLUSHALL")

    def master_of(self, key: str) -> ClusterNode:
        """The running node that serves ``key``'s slot now."""
        for node in self.nodes:
            if not node.running:
                continue
            slot = int(node.command("CLUSTER", "KEYSLOT", key))
            for line in node.text("CLUSTER", "NODES").splitlines():
                parts = line.split(" ")
                if len(parts) < 8 or "master" not in parts[2] or "fail" in parts[2]:
                    continue
                for span in parts[8:]:
                    low, _, high = span.partition("-")
                    if low.isdigit() and int(low) <= slot <= int(high or low):
                        port = int(parts[1].split("@")[0].rpartition(":")[2])
                        return next(n for n in self.nodes if n.port == port)
        raise LocalError(f"no master serves {key!r}")

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


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
            if "master_link_status:up" in self.node.text("INFO", "replication"):
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


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (held open together while chosen)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
