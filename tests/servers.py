"""Real servers for the tests: a private ``redis-server`` that a test may stop and restart."""

from router.cli.local import RedisServer

__all__ = ["RedisServer"]
