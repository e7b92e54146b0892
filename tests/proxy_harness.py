"""The proxy as users run it: ``kvledger serve`` in its own process, on a real port."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.sim.launcher import Replica, config_snippet
from router.cli.local import ProxyProcess, create_key


class Proxy(ProxyProcess):
    """A proxy in front of ``replicas``; the admin token is ``admin-secret``."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        redis_url: str,
        *,
        policy: str = "prefix_affinity",
        extra: str = "",
        monitor_interval_s: float = 0.5,
    ) -> None:
        super().__init__(
            config_snippet(replicas),
            redis_url,
            policy=policy,
            extra=extra,
            monitor_interval_s=monitor_interval_s,
        )

    def create_key(self, name: str, **profile: Any) -> str:
        return create_key(self.redis_url, name, **profile)
