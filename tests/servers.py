"""Real servers for the tests: a private ``redis-server`` that a test may stop and restart, its
replica, and a local Redis Cluster (3 masters, 1 replica each) of real ``redis-server``s."""

from __future__ import annotations

from router.cli.cluster import ClusterNode, LocalCluster, RedisReplica
from router.cli.local import RedisServer

__all__ = ["ClusterNode", "LocalCluster", "RedisReplica", "RedisServer"]
