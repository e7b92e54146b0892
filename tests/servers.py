"""Real servers for the tests: a private ``redis-server`` that a test may stop and restart, its
replica, and a local Redis Cluster (3 masters, 1 replica each) of real ``redis-server``s."""

from __future__ import annotations

import redis

from router.cli.cluster import ClusterNode, LocalCluster, RedisReplica
from router.cli.local import RedisServer

__all__ = ["ClusterNode", "LocalCluster", "RedisReplica", "RedisServer", "redis_answers"]


def redis_answers(url: str) -> bool:
    """A Redis server answers PING at ``url``."""
    client = redis.Redis.from_url(url)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()
