"""A proxy configured as the hostile-input and fault tests need it, in front of real replicas."""

from __future__ import annotations

from collections.abc import Sequence

from backends.sim.launcher import Replica, config_snippet
from router.cli.local import ProxyProcess

MAX_INPUT_LEN = 1024  # tokens; the stand-in's tokenizer is byte-level (one byte, one token)
ADMIN = "admin-secret"


def limited_replicas(replicas: Sequence[Replica], max_input_len: int = MAX_INPUT_LEN) -> str:
    """The replicas' config tables, each with its input-length limit and bytes per token."""
    tables = config_snippet(replicas).split("[[replicas]]\n")
    limit = f"max_input_len = {max_input_len}\n"  # max_token_bytes = 1: config_snippet says so
    return "".join(f"[[replicas]]\n{limit}{t}" for t in tables if t.strip())


def hostile_proxy(
    replicas: Sequence[Replica],
    redis_url: str,
    *,
    extra: str = "",
    policy: str = "prefix_affinity",
    monitor_interval_s: float = 0.5,
) -> ProxyProcess:
    """``kvledger serve`` with input limits per replica; ``extra`` TOML goes into ``[server]``
    (and may open further tables after it)."""
    return ProxyProcess(
        limited_replicas(replicas),
        redis_url,
        extra=extra,
        policy=policy,
        monitor_interval_s=monitor_interval_s,
        admin_token=ADMIN,
    )
