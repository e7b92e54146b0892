"""Shared fixtures: real Redis and real Triton stand-in replicas, started once and stopped after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import ModelSettings
from tests.servers import RedisServer


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
def replicas() -> Iterator[dict[str, Replica]]:
    """Three stand-in replicas for the session: r1 and r2 with block reuse, r3 without."""
    specs = [
        ReplicaSpec("r1"),
        ReplicaSpec("r2"),
        ReplicaSpec("r3", ModelSettings(reuse=False)),
    ]
    with launch(specs) as running:
        yield {r.id: r for r in running}
