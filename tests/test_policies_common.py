"""Every policy: eligibility, the registry, block hashes, and the choice always eligible."""

from __future__ import annotations

import hashlib
import random

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
)
from tests.policy_helpers import ALL_POLICIES, features, random_prompts, replica

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
    pytest.param({"production": False}, id="eval-only"),
    pytest.param({"healthy": False}, id="unhealthy"),
    pytest.param({"leased": True}, id="leased"),
    pytest.param({"draining": True}, id="draining"),
]


@pytest.mark.parametrize("flag", INELIGIBLE)
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_ineligible_replica_is_never_chosen(name: PolicyName, flag: dict[str, bool]) -> None:
    """An eval-only, unhealthy, leased or draining replica gets no traffic even when idlest."""
    policy = make_policy(name)
    fleet = [replica("r1", 0, **flag), replica("r2", 9), replica("r3", 9)]
    for n, prompt in enumerate(random_prompts(60)):
        decision = policy.select(features(prompt), fleet)
        policy.on_start(decision.replica, features(prompt), float(n))
        assert decision.replica != "r1"
        assert "r1" not in decision.candidates


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_no_eligible_replica_raises_with_every_reason(name: PolicyName) -> None:
    """With nothing eligible, the error names each replica and why it was passed over."""
    fleet = [
        replica("r1", healthy=False),
        replica("r2", leased=True),
        replica("r3", draining=True, healthy=False),
        replica("r4", production=False),
    ]
    with pytest.raises(NoReplicaAvailable) as err:
        make_policy(name).select(features("a" * 40), fleet)
    assert str(err.value) == (
        "no eligible replica: r1 unhealthy; r2 leased; r3 unhealthy, draining; r4 eval-only"
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


# -- registry ------------------------------------------------------------------------------


def test_registry_covers_every_policy_name() -> None:
    """Every PolicyName has a constructor, and each builds a policy of that name."""
    assert set(POLICIES) == set(ALL_POLICIES)
    for name in ALL_POLICIES:
        policy = make_policy(name)
        assert isinstance(policy, Policy) and policy.name == name


def test_make_policy_rejects_unknown_name() -> None:
    """An unknown policy name fails with the list of known ones."""
    with pytest.raises(
        ValueError, match="round_robin, least_loaded, prefix_affinity, longest_prefix"
    ):
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
    production=st.sampled_from([True, True, True, False]),
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
    eligible = {
        r.id for r in fleet if r.production and r.healthy and not r.leased and not r.draining
    }
    try:
        decision = policy.select(features(prompt), fleet)
    except NoReplicaAvailable:
        assert not eligible
        return
    assert decision.replica in eligible
    assert decision.candidates[0] == decision.replica
    assert sorted(decision.candidates) == sorted(eligible)


@pytest.mark.parametrize(
    ("name", "options"),
    [(n, {}) for n in ALL_POLICIES] + [("prefix_affinity", {"affinity_blocks": 3})],
)
def test_a_policy_decides_alike_on_only_the_block_hashes_it_reads(
    name: PolicyName, options: dict[str, int]
) -> None:
    """The router hashes only ``policy.prefix_blocks`` leading blocks of a prompt: with them
    alone, every decision (and what the policy learns from it) is the one it makes with all
    of them. Conversations that share a system prompt and grow turn by turn, under load."""
    full, cut = make_policy(name, **options), make_policy(name, **options)
    assert 0 <= cut.prefix_blocks
    rng = random.Random(3)
    system = "You are a careful agent with tools. " * 4
    turns = {c: system + f"conversation {c}: " for c in range(6)}
    now = 0.0
    for step in range(120):
        c = rng.randrange(6)
        turns[c] += f"turn {step} asks something new. " * rng.randint(1, 3)
        hashes = prefix_block_hashes(turns[c], 16, 64)
        pool = [replica(r, in_flight=rng.randrange(4)) for r in ("r1", "r2", "r3")]
        chosen = []
        for policy, blocks in ((full, hashes), (cut, hashes[: cut.prefix_blocks])):
            request = RequestFeatures(prefix_hashes=blocks, prompt_tokens=1, model="m")
            decision = policy.select(request, pool)
            policy.on_start(decision.replica, request, now)
            chosen.append((decision.replica, decision.candidates))
        assert chosen[0] == chosen[1], (name, step)
        now += 1.0
