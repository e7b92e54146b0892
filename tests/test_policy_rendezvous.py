"""Rendezvous hashing: reproducible orders that move only what must move."""

from __future__ import annotations

from collections import Counter

from policies import (
    rendezvous_order,
)
from policies.rendezvous import cached_order
from tests.policy_helpers import random_prompts

# -- rendezvous_order ----------------------------------------------------------------------


def test_rendezvous_order_is_pinned_across_processes_and_releases() -> None:
    """The ranking is a fixed function of key and ids, never of Python's salted hash()."""
    assert rendezvous_order("arm-a", ["r1", "r2", "r3"]) == ["r3", "r2", "r1"]
    assert rendezvous_order("arm-b", ["r1", "r2", "r3"]) == ["r2", "r3", "r1"]


def test_rendezvous_order_ignores_input_order() -> None:
    """Two proxies listing the replicas differently still rank them the same."""
    for key in random_prompts(50):
        assert rendezvous_order(key, ["r1", "r2", "r3"]) == rendezvous_order(
            key, ["r3", "r1", "r2"]
        )


def test_removing_a_replica_only_remaps_its_own_keys() -> None:
    """Dropping r2 moves exactly the keys whose first choice was r2."""
    keys = random_prompts(300)
    before = {k: rendezvous_order(k, ["r1", "r2", "r3", "r4"])[0] for k in keys}
    after = {k: rendezvous_order(k, ["r1", "r3", "r4"])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r2"}
    assert moved  # the test would be vacuous if r2 owned no key


def test_weighted_rendezvous_shares_keys_by_weight() -> None:
    """A replica of weight 2 is first for about twice as many keys as one of weight 1."""
    keys = random_prompts(3000)
    weights = {"r1": 1.0, "r2": 2.0, "r3": 1.0}
    firsts = Counter(rendezvous_order(k, list(weights), weights)[0] for k in keys)
    assert 0.45 < firsts["r2"] / len(keys) < 0.55


def test_a_remembered_ranking_is_the_ranking_of_its_own_replicas_and_weights() -> None:
    """The policies' cached ranking answers as a fresh one would, also when the same key comes
    back over other replicas or other weights (which must not find the first one's answer)."""
    fleets = [
        (("r1", "r2", "r3"), (1.0, 1.0, 1.0)),
        (("r1", "r2", "r3"), (1.0, 3.0, 1.0)),
        (("r1", "r3"), (1.0, 1.0)),
        (("r2", "r3", "r4", "r5"), (2.0, 1.0, 1.0, 0.5)),
    ]
    for _ in range(2):  # the second pass is answered from the cache
        for key in random_prompts(40):
            for ids, weights in fleets:
                fresh = rendezvous_order(key, ids, dict(zip(ids, weights, strict=True)))
                assert list(cached_order(key, ids, weights)) == fresh
    assert cached_order.cache_info().hits > 0
