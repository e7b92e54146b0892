"""Real servers for the tests: a private ``redis-server`` that a test may stop and restart, and a
local Redis Cluster (3 masters, 1 replica each) of real ``redis-server`` processes."""

from router.cli.cluster import ClusterNode, LocalCluster
from router.cli.local import RedisServer

__all__ = ["ClusterNode", "LocalCluster", "RedisServer"]
