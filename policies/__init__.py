"""Routing policies: pure functions from request features and replica views to a decision.

Choose one by name from ``POLICIES`` (``make_policy("longest_prefix", load_factor=1.5)``).
Every policy passes over replicas that are eval-only, unhealthy, leased or draining, and raises
``NoReplicaAvailable`` when nothing is left. ``longest_prefix`` is the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

from policies.base import (
    MAX_PREFIX_BLOCKS,
    Decision,
    NoReplicaAvailable,
    Policy,
    ReplicaView,
    RequestFeatures,
    eligible,
    prefix_block_hashes,
)
from policies.least_loaded import LeastLoaded
from policies.longest_prefix import LongestPrefix
from policies.prefix_affinity import PrefixAffinity
from policies.prefix_index import PrefixIndex
from policies.rendezvous import rendezvous_order
from policies.round_robin import RoundRobin

PolicyName = Literal["round_robin", "least_loaded", "prefix_affinity", "longest_prefix"]
DEFAULT_POLICY: PolicyName = "longest_prefix"

# Constructors, not instances: each router app builds its own, so no state is shared.
POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix_affinity": PrefixAffinity,
    "longest_prefix": LongestPrefix,
}


def make_policy(name: PolicyName | str, **options: object) -> Policy:
    """A fresh policy of the given name, built with ``options`` (e.g. ``load_factor``).

    Raises ``ValueError`` for an unknown name and ``TypeError`` for an unknown option.
    """
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(get_args(PolicyName))
        raise ValueError(f"unknown routing policy {name!r}; expected one of: {known}") from None
    return factory(**options)


__all__ = [
    "DEFAULT_POLICY",
    "MAX_PREFIX_BLOCKS",
    "POLICIES",
    "Decision",
    "LeastLoaded",
    "LongestPrefix",
    "NoReplicaAvailable",
    "Policy",
    "PolicyName",
    "PrefixAffinity",
    "PrefixIndex",
    "ReplicaView",
    "RequestFeatures",
    "RoundRobin",
    "eligible",
    "make_policy",
    "prefix_block_hashes",
    "rendezvous_order",
]
