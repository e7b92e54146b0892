"""The Redis client: the one place outside the ledger's modules that needs its type opens it.

The proxy keeps short timeouts (a stalled Redis must not stall requests: the writer spools);
commands that read a large lineage allow longer ones.

Cluster mode: a URL ``redis+cluster://[user:password@]host:port,host:port`` (any masters or
replicas of the cluster; the rest are found by ``CLUSTER SLOTS``) opens redis-py's asyncio
``RedisCluster``. ``[server] redis_cluster = true`` turns a plain ``redis://host:port`` URL
into that (see ``router.settings``). The cluster client is typed as :data:`RedisClient`: the
ledger uses only the commands both speak, each on keys of one hash tag (``kvl:{replica:ID}:...``),
and pipelines without transactions, which the cluster client splits by node.
"""

from __future__ import annotations

from typing import cast
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

RedisClient = aioredis.Redis

CLUSTER_SCHEME = "redis+cluster"


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() == CLUSTER_SCHEME


def is_cluster(client: object) -> bool:
    """True for a client :func:`connect` opened on a cluster."""
    return isinstance(client, RedisCluster)


def cluster_url(url: str) -> str:
    """``url`` in cluster form (``redis://h:p/0`` becomes ``redis+cluster://h:p``)."""
    if is_cluster_url(url):
        return url
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "redis":
        raise ValueError(f"cluster mode takes a redis:// URL, not {scheme or url!r}")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0")
    return f"{CLUSTER_SCHEME}://{netloc}"


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """The startup nodes, user name and password of a ``redis+cluster://`` URL; ValueError
    when it names no node, a bad port or a database other than 0."""
    _, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("not a URL")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = item.strip(), "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad cluster node {item!r}")
        nodes.append((host, int(port)))
    return nodes, username, password


def connect(
    url: str,
    *,
    timeout_s: float | None = 0.5,
    connect_timeout_s: float = 0.5,
    health_check_s: int = 5,
) -> RedisClient:
    """A client of the Redis at ``url`` (it connects on first use); ValueError for a bad URL.
    ``timeout_s`` None: reads wait as long as it takes (a subscriber)."""
    if is_cluster_url(url):
        nodes, username, password = parse_cluster_url(url)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            username=username,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            health_check_interval=health_check_s,
            # Slots without a master (a failover under way) must not fail every command:
            # keys of the other slots still work, and a failing one is retried or spooled.
            require_full_coverage=False,
        )
        return cast(RedisClient, cluster)
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=health_check_s,
    )
