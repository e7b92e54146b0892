"""The routing policies: pure functions, tested without an event loop or any server."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import (
    POLICIES,
    NoReplicaAvailable,
    Policy,
    PolicyName,
    PrefixAffinity,
    ReplicaView,
    RequestFeatures,
    make_policy,
    prefix_block_hashes,
    rendezvous_order,
)
from policies.prefix_affinity import load_bound

ALL_POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)


def replica(
    rid: str,
    in_flight: int = 0,
    *,
    healthy: bool = True,
    leased: bool = False,
    draining: bool = False,
    weight: float = 1.0,
) -> ReplicaView:
    return ReplicaView(rid, healthy, leased, draining, in_flight, weight)


def features(prompt: str) -> RequestFeatures:
    hashes = prefix_block_hashes(prompt)
    return RequestFeatures(prefix_hashes=hashes, prompt_tokens=len(prompt.encode()), model="m")


def random_prompts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x} system prompt and question" for _ in range(n)]


FLEET = [replica("r1"), replica("r2"), replica("r3")]


# -- prefix_block_hashes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "block", "max_blocks", "expected_blocks"),
    [
        ("", 16, 4, 0),
        ("a" * 15, 16, 4, 0),
        ("a" * 16, 16, 4, 1),
        ("a" * 47, 16, 4, 2),
        ("a" * 200, 16, 4, 4),
        ("a" * 200, 16, 2, 2),
        ("é" * 8, 16, 4, 1),  # 8 characters, 16 UTF-8 bytes: one full block
        ("abcdef", 2, 4, 3),
    ],
)
def test_prefix_block_hashes_counts_only_full_byte_blocks(
    text: str, block: int, max_blocks: int, expected_blocks: int
) -> None:
    """Only full blocks of UTF-8 bytes are hashed, up to max_blocks."""
    assert len(prefix_block_hashes(text, block, max_blocks)) == expected_blocks


def test_prefix_block_hashes_are_chained_blake2b_of_each_prefix() -> None:
    """Hash i is blake2b-64 of every byte up to the end of block i."""
    text = "naïve façade, résumé " * 3  # multi-byte characters: blocks split by bytes
    raw = text.encode("utf-8")
    expected = tuple(
        hashlib.blake2b(raw[: 16 * (i + 1)], digest_size=8).hexdigest() for i in range(4)
    )
    assert len(raw) >= 64
    assert prefix_block_hashes(text) == expected


def test_prefix_block_hashes_share_blocks_only_up_to_the_first_difference() -> None:
    """Prompts that diverge in block 1 share hash 0 and differ from hash 1 on."""
    a = prefix_block_hashes("x" * 16 + "a" * 32)
    b = prefix_block_hashes("x" * 16 + "b" * 32)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_prefix_block_hashes_rejects_bad_block_size() -> None:
    """A block size below one token is a configuration error, not an empty result."""
    with pytest.raises(ValueError, match="tokens_per_block"):
        prefix_block_hashes("abc", 0)


# -- eligibility, for every policy ---------------------------------------------------------

INELIGIBLE = [
    pytest.param({"healthy": False}, id="unhealthy"),
    pytest.param({"leased": True}, id="leased"),
    pytest.param({"draining": True}, id="draining"),
]


@pytest.mark.parametrize("flag", INELIGIBLE)
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_ineligible_replica_is_never_chosen(name: PolicyName, flag: dict[str, bool]) -> None:
    """An unhealthy, leased or draining replica gets no traffic even when it is idlest."""
    policy = make_policy(name)
    fleet = [replica("r1", 0, **flag), replica("r2", 9), replica("r3", 9)]
    for prompt in random_prompts(60):
        decision = policy.select(features(prompt), fleet)
        policy.on_start(decision.replica)
        assert decision.replica != "r1"
        assert "r1" not in decision.candidates


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_no_eligible_replica_raises_with_every_reason(name: PolicyName) -> None:
    """With nothing eligible, the error names each replica and why it was passed over."""
    fleet = [
        replica("r1", healthy=False),
        replica("r2", leased=True),
        replica("r3", draining=True, healthy=False),
    ]
    with pytest.raises(NoReplicaAvailable) as err:
        make_policy(name).select(features("a" * 40), fleet)
    assert str(err.value) == (
        "no eligible replica: r1 unhealthy; r2 leased; r3 unhealthy, draining"
    )
    assert err.value.reasons["r2"] == ("leased",)


def test_no_replicas_at_all_says_so() -> None:
    """An empty fleet raises NoReplicaAvailable saying no replicas are configured."""
    with pytest.raises(NoReplicaAvailable, match="no replicas configured"):
        make_policy("least_loaded").select(features("a"), [])


@pytest.mark.parametrize(
    ("in_flight", "weight"), [(-1, 1.0), (0, 0.0), (0, -2.0), (0, float("nan")), (0, float("inf"))]
)
def test_replica_view_rejects_impossible_load(in_flight: int, weight: float) -> None:
    """A negative in-flight count or a non-positive weight is refused at construction."""
    with pytest.raises(ValueError):
        replica("r1", in_flight, weight=weight)


# -- round_robin ---------------------------------------------------------------------------


def run_round_robin(policy: Policy, fleets: list[list[ReplicaView]]) -> list[str]:
    chosen = []
    for fleet in fleets:
        decision = policy.select(features(""), fleet)
        policy.on_start(decision.replica)
        chosen.append(decision.replica)
    return chosen


@pytest.mark.parametrize(
    ("fleets", "expected"),
    [
        ([FLEET] * 7, ["r1", "r2", "r3", "r1", "r2", "r3", "r1"]),
        ([list(reversed(FLEET))] * 4, ["r1", "r2", "r3", "r1"]),
        (
            [FLEET, FLEET, [replica("r1"), replica("r2"), replica("r3", draining=True)], FLEET],
            ["r1", "r2", "r1", "r2"],
        ),
        ([FLEET, [replica("r1"), replica("r3")], FLEET], ["r1", "r3", "r1"]),
    ],
    ids=["cycles", "input-order-irrelevant", "skips-draining", "replica-removed"],
)
def test_round_robin_cycles_in_id_order(
    fleets: list[list[ReplicaView]], expected: list[str]
) -> None:
    """Round robin visits eligible replicas in id order and wraps around."""
    assert run_round_robin(make_policy("round_robin"), fleets) == expected


def test_round_robin_cursor_moves_only_on_start() -> None:
    """select alone does not advance the cursor; on_start does."""
    policy = make_policy("round_robin")
    assert policy.select(features(""), FLEET).replica == "r1"
    assert policy.select(features(""), FLEET).replica == "r1"
    policy.on_start("r1")
    decision = policy.select(features(""), FLEET)
    assert (decision.replica, decision.candidates) == ("r2", ("r2", "r3", "r1"))
    assert decision.reason == "round_robin: next after r1 -> r2"


# -- least_loaded --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fleet", "expected", "candidates"),
    [
        ([replica("r1", 4), replica("r2", 1), replica("r3", 2)], "r2", ("r2", "r3", "r1")),
        ([replica("r3", 1), replica("r2", 1), replica("r1", 5)], "r2", ("r2", "r3", "r1")),
        ([replica("b", 0), replica("a", 0)], "a", ("a", "b")),
        ([replica("r1", 2), replica("r2", 3, weight=2.0)], "r2", ("r2", "r1")),
        ([replica("r1", 0), replica("r2", 0, weight=2.0)], "r2", ("r2", "r1")),
    ],
    ids=["fewest", "tie-by-id", "tie-idle", "weighted", "weighted-idle"],
)
def test_least_loaded_picks_min_in_flight(
    fleet: list[ReplicaView], expected: str, candidates: tuple[str, ...]
) -> None:
    """Least loaded takes the replica with the fewest in flight per unit of weight."""
    decision = make_policy("least_loaded").select(features(""), fleet)
    assert (decision.replica, decision.candidates) == (expected, candidates)
    assert decision.policy == "least_loaded"
    assert decision.reason.startswith(f"least_loaded: {expected} at ")


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


# -- registry ------------------------------------------------------------------------------


def test_registry_covers_every_policy_name() -> None:
    """Every PolicyName has a constructor, and each builds a policy of that name."""
    assert set(POLICIES) == set(ALL_POLICIES)
    for name in ALL_POLICIES:
        policy = make_policy(name)
        assert isinstance(policy, Policy) and policy.name == name


def test_make_policy_rejects_unknown_name() -> None:
    """An unknown policy name fails with the list of known ones."""
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_affinity"):
        make_policy("random")


def test_make_policy_passes_options() -> None:
    """Options reach the constructor."""
    policy = make_policy("prefix_affinity", load_factor=2.0)
    assert isinstance(policy, PrefixAffinity) and policy.load_factor == 2.0


# -- property: the choice is always eligible -----------------------------------------------

replica_views = st.builds(
    ReplicaView,
    id=st.sampled_from(["r1", "r2", "r3", "r4", "r5"]),
    healthy=st.booleans(),
    leased=st.booleans(),
    draining=st.booleans(),
    in_flight=st.integers(0, 50),
    capacity_weight=st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0]),
)
fleets = st.lists(replica_views, max_size=5, unique_by=lambda r: r.id)


@given(
    name=st.sampled_from(ALL_POLICIES),
    fleet=fleets,
    prompt=st.text(max_size=80),
    affinity_blocks=st.integers(1, 5),
)
def test_choice_is_always_an_eligible_replica(
    name: PolicyName, fleet: list[ReplicaView], prompt: str, affinity_blocks: int
) -> None:
    """Any policy, any fleet: the choice is eligible, or NoReplicaAvailable is raised."""
    options = {"affinity_blocks": affinity_blocks} if name == "prefix_affinity" else {}
    policy = make_policy(name, **options)
    eligible = {r.id for r in fleet if r.healthy and not r.leased and not r.draining}
    try:
        decision = policy.select(features(prompt), fleet)
    except NoReplicaAvailable:
        assert not eligible
        return
    assert decision.replica in eligible
    assert decision.candidates[0] == decision.replica
    assert sorted(decision.candidates) == sorted(eligible)
