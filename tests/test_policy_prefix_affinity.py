"""prefix_affinity: a prefix's home replica, with bounded load."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import (
    PrefixAffinity,
    RequestFeatures,
    make_policy,
    rendezvous_order,
)
from policies.prefix_affinity import load_bound
from tests.policy_helpers import FLEET, features, random_prompts, replica

# -- prefix_affinity -----------------------------------------------------------------------


def test_same_prefix_same_replica_across_independent_proxies() -> None:
    """Two fresh policy instances (two proxies) send each prefix to the same replica."""
    proxy_a, proxy_b = make_policy("prefix_affinity"), make_policy("prefix_affinity")
    for prompt in random_prompts(100):
        a = proxy_a.select(features(prompt), FLEET)
        b = proxy_b.select(features(prompt), list(reversed(FLEET)))
        assert a == b
        assert a.reason.startswith("affinity: prefix block 0 (")


def test_prompts_sharing_the_leading_block_share_a_replica() -> None:
    """Different questions after the same 16-byte system prompt land together."""
    policy = make_policy("prefix_affinity")
    chosen = {policy.select(features("You are a helper" + q), FLEET).replica for q in "abcdefgh"}
    assert len(chosen) == 1


def test_distinct_prefixes_spread_over_replicas() -> None:
    """200 random prefixes over 3 idle replicas give each more than 15% of them."""
    policy = make_policy("prefix_affinity")
    counts = Counter(policy.select(features(p), FLEET).replica for p in random_prompts(200))
    assert set(counts) == {"r1", "r2", "r3"}
    assert min(counts.values()) > 0.15 * 200


@pytest.mark.parametrize(
    ("total", "n", "c", "bound"),
    [(0, 3, 1.25, 1), (2, 3, 1.25, 2), (5, 3, 1.25, 3), (11, 3, 1.25, 5), (9, 2, 1.0, 5)],
)
def test_load_bound_is_ceil_c_times_mean(total: int, n: int, c: float, bound: int) -> None:
    """The bound is ceil(c * (total_in_flight + 1) / n_eligible)."""
    assert load_bound(total, 1.0, float(n), c) == bound


def home_of(prompt: str) -> str:
    return rendezvous_order(features(prompt).prefix_hashes[0], ["r1", "r2", "r3"])[0]


def test_hot_prefix_spills_when_its_home_is_over_the_bound() -> None:
    """A home at 3 in flight (bound ceil(1.25*4/3) = 2) is skipped for the next in rank."""
    prompt = random_prompts(1)[0]
    ranking = rendezvous_order(features(prompt).prefix_hashes[0], ["r1", "r2", "r3"])
    fleet = [replica(rid, 3 if rid == ranking[0] else 0) for rid in ["r1", "r2", "r3"]]
    decision = make_policy("prefix_affinity").select(features(prompt), fleet)
    assert decision.replica == ranking[1]
    assert decision.candidates == (ranking[1], ranking[0], ranking[2])
    assert (
        decision.reason
        == f"spill: home {ranking[0]} at 3 in flight, bound 2 -> {ranking[1]} (rank 2)"
    )


def test_hot_prefix_stays_home_while_within_the_bound() -> None:
    """A home at the bound minus one still takes the request."""
    prompt = random_prompts(1)[0]
    home = home_of(prompt)
    fleet = [replica(rid, 2 if rid == home else 1) for rid in ["r1", "r2", "r3"]]
    # total 4: bound ceil(1.25 * 5 / 3) = 3, and 2 + 1 <= 3
    assert make_policy("prefix_affinity").select(features(prompt), fleet).replica == home


def test_hot_prefix_load_stays_within_the_bound() -> None:
    """Thirty concurrent requests for one prefix never push a replica past its bound."""
    policy = make_policy("prefix_affinity")
    load = {"r1": 0, "r2": 0, "r3": 0}
    for _ in range(30):
        fleet = [replica(rid, n) for rid, n in load.items()]
        chosen = policy.select(features("hot " * 10), fleet).replica
        assert load[chosen] + 1 <= load_bound(sum(load.values()), 1.0, 3.0, 1.25)
        load[chosen] += 1
    # Home and runner-up fill to the bound first; the third takes only what is left.
    ranking = rendezvous_order(features("hot " * 10).prefix_hashes[0], list(load))
    assert load[ranking[0]] >= load[ranking[1]] >= load[ranking[2]] > 0


def test_prompt_without_a_full_block_falls_back_to_least_loaded() -> None:
    """A prompt shorter than one block goes to the least loaded replica, and says so."""
    fleet = [replica("r1", 3), replica("r2", 1), replica("r3", 2)]
    decision = make_policy("prefix_affinity").select(features("short"), fleet)
    assert decision.replica == "r2"
    assert decision.reason == ("least_loaded fallback: prompt has no full block; r2 at 1 in flight")


@pytest.mark.parametrize(("affinity_blocks", "used"), [(1, 0), (2, 1), (3, 2), (9, 3)])
def test_affinity_key_is_the_deepest_configured_block(affinity_blocks: int, used: int) -> None:
    """affinity_blocks=k keys on prefix_hashes[min(k, len) - 1]."""
    hashes = ("h0", "h1", "h2", "h3")
    request = RequestFeatures(hashes, 64, "m")
    decision = PrefixAffinity(affinity_blocks=affinity_blocks).select(request, FLEET)
    assert decision.replica == rendezvous_order(hashes[used], ["r1", "r2", "r3"])[0]
    assert decision.reason.startswith(f"affinity: prefix block {used} ")


@pytest.mark.parametrize("options", [{"load_factor": 0.9}, {"affinity_blocks": 0}])
def test_prefix_affinity_rejects_bad_options(options: dict[str, float]) -> None:
    """A load factor below 1 or fewer than one affinity block is refused up front."""
    with pytest.raises(ValueError):
        make_policy("prefix_affinity", **options)
