"""Shared fixtures: real Redis and real Triton stand-in replicas, started once and stopped after."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import ModelSettings
from router.cli.local import ProxyProcess
from tests.servers import LocalCluster, RedisServer

LOG_LINES = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """A failed test's report carries the end of the log of every proxy still running or
    written to during the test: what a proxy did while the test waited is often the only clue
    (in CI, the only one)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for proxy in list(ProxyProcess.recent):
        try:
            written = proxy.log_path.stat().st_mtime
        except OSError:
            continue
        if proxy.running or written >= call.start:
            tail = "\n".join(proxy.log.splitlines()[-LOG_LINES:])
            report.sections.append((f"proxy {proxy.url} log, last {LOG_LINES} lines", tail))


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for one test, which the test may stop and start again."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A Redis Cluster for the session: 3 masters, 1 replica each (cluster-node-timeout 1 s).
    Tests that use it flush it first; a test that kills a node starts a cluster of its own."""
    cluster = LocalCluster(3, 1, node_timeout_ms=1000)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def replicas() -> Iterator[dict[str, Replica]]:
    """Three stand-in replicas for the session: r1 and r2 with block reuse, r3 without."""
    specs = [
        ReplicaSpec("r1"),
        ReplicaSpec("r2"),
        ReplicaSpec("r3", ModelSettings(reuse=False)),
    ]
    with launch(specs) as running:
        yield {r.id: r for r in running}
