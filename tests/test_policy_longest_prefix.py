"""longest_prefix: follow-ups go home, new conversations spread, independent proxies agree."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import (
    MAX_PREFIX_BLOCKS,
    LongestPrefix,
    NoReplicaAvailable,
    ReplicaView,
    RequestFeatures,
    make_policy,
    rendezvous_order,
)
from tests.policy_helpers import features, replica

SYSTEM = "You are a support agent for a hosting company. Answer briefly and cite the docs. " * 3
FOUR = [replica(f"r{i}") for i in range(1, 5)]


def chat(system: str, *messages: str) -> RequestFeatures:
    """The prompt the proxy renders for a conversation so far (user, assistant, user, ...)."""
    text = f"<|system|>\n{system}\n"
    for n, content in enumerate(messages):
        text += f"<|{'user' if n % 2 == 0 else 'assistant'}|>\n{content}\n"
    return features(text + "<|assistant|>\n", MAX_PREFIX_BLOCKS)


def route(policy: LongestPrefix, request: RequestFeatures, fleet: list[ReplicaView]) -> str:
    decision = policy.select(request, fleet)
    policy.on_start(decision.replica, request, 0.0)
    return decision.replica


def conversation(n: int) -> tuple[str, ...]:
    """Five turns of user and assistant messages, distinct per ``n``."""
    return tuple(f"message {i} of conversation {n}: " + "details " * (3 + i) for i in range(9))


def warm(policy: LongestPrefix, count: int = 3, first: int = 1000) -> None:
    """Other conversations on the same system prompt, so the policy knows it is shared."""
    for n in range(first, first + count):
        route(policy, chat(SYSTEM, conversation(n)[0]), FOUR)


def test_follow_up_turns_stay_on_the_conversations_replica() -> None:
    """Turns 2 to 5 of a chat go where turn 1 went, whatever their own blocks hash to."""
    policy = make_policy("longest_prefix")
    assert isinstance(policy, LongestPrefix)
    warm(policy)
    messages = conversation(1)
    first = route(policy, chat(SYSTEM, messages[0]), FOUR)
    for turn in range(2, 6):
        request = chat(SYSTEM, *messages[: 2 * turn - 1])
        decision = policy.select(request, FOUR)
        assert decision.replica == first
        assert decision.reason.startswith("longest prefix: ")
        assert decision.reason.endswith(f"continue a prompt sent to {first} -> {first}")
        policy.on_start(decision.replica, request, 0.0)


def test_conversations_sharing_only_a_system_prompt_spread_out() -> None:
    """200 conversations on one system prompt land on every replica, none above 40%."""
    policy = make_policy("longest_prefix")
    assert isinstance(policy, LongestPrefix)
    counts = Counter(route(policy, chat(SYSTEM, conversation(n)[0]), FOUR) for n in range(200))
    assert set(counts) == {"r1", "r2", "r3", "r4"}
    assert max(counts.values()) < 0.4 * 200


def test_a_new_conversation_branches_off_the_shared_prompt_at_its_first_own_block() -> None:
    """Its home is the rendezvous winner of the first block it does not share."""
    policy = make_policy("longest_prefix")
    assert isinstance(policy, LongestPrefix)
    warm(policy)
    request = chat(SYSTEM, "a brand new question")
    shared = len(chat(SYSTEM, "").prefix_hashes) - 1  # the system prompt's full blocks
    decision = policy.select(request, FOUR)
    key = request.prefix_hashes[shared]
    assert decision.replica == rendezvous_order(key, ["r1", "r2", "r3", "r4"])[0]
    n = len(request.prefix_hashes)
    assert decision.reason == (
        f"new branch: {shared} of {n} blocks shared, home of block {shared} ({key[:8]})"
        f" -> {decision.replica}"
    )


def test_two_warm_proxies_agree_on_a_new_conversation_and_its_follow_up() -> None:
    """Proxies that never talked, each knowing the system prompt from other traffic: turn 1
    via one and turn 2 via the other reach the same replica, for every conversation."""
    for n in range(40):
        proxy_a, proxy_b = LongestPrefix(), LongestPrefix()
        warm(proxy_a, first=1000)
        warm(proxy_b, first=2000)  # different conversations: they share only the system prompt
        messages = conversation(n)
        home = route(proxy_a, chat(SYSTEM, messages[0]), FOUR)
        assert proxy_b.select(chat(SYSTEM, messages[0]), FOUR).replica == home
        assert route(proxy_b, chat(SYSTEM, *messages[:3]), FOUR) == home


def test_two_cold_proxies_agree_on_a_new_conversation() -> None:
    """With empty indexes both proxies key a prompt by its first block."""
    for n in range(20):
        request = chat(SYSTEM, conversation(n)[0])
        a = LongestPrefix().select(request, FOUR)
        b = LongestPrefix().select(request, list(reversed(FOUR)))
        assert a == b
        assert a.reason.startswith("new prefix: home of block 0 (")


def test_repeating_a_prompt_goes_where_it_went() -> None:
    """The same prompt again (a retry) matches all its blocks and follows them."""
    policy = LongestPrefix()
    request = chat(SYSTEM, "retry me")
    first = route(policy, request, FOUR)
    assert policy.select(request, FOUR).replica == first


def loaded(home: str, at: int, rest: int = 1) -> list[ReplicaView]:
    return [replica(r.id, at if r.id == home else rest) for r in FOUR]


def test_follow_up_within_the_looser_bound_stays_home() -> None:
    """A follow-up stays on its replica above the new-prefix bound, up to follow_load_factor."""
    policy = LongestPrefix(load_factor=1.25, follow_load_factor=2.0)
    messages = conversation(7)
    home = route(policy, chat(SYSTEM, messages[0]), FOUR)
    # total 6 in flight: new-prefix bound ceil(1.25 * 7 / 4) = 3, follow bound ceil(2 * 7 / 4) = 4
    decision = policy.select(chat(SYSTEM, *messages[:3]), loaded(home, 3))
    assert decision.replica == home


def test_follow_up_over_its_bound_spills_to_the_least_loaded() -> None:
    """Over follow_load_factor the follow-up goes to the least loaded replica, saying why."""
    policy = LongestPrefix(load_factor=1.25, follow_load_factor=2.0)
    messages = conversation(8)
    home = route(policy, chat(SYSTEM, messages[0]), FOUR)
    fleet = [replica(r.id, 9 if r.id == home else 1) for r in FOUR]
    idlest = next(r.id for r in FOUR if r.id != home)
    fleet = [replica(r.id, 0) if r.id == idlest else r for r in fleet]
    decision = policy.select(chat(SYSTEM, *messages[:3]), fleet)
    assert decision.replica == idlest
    assert decision.candidates[:2] == (idlest, home)
    # total 11 in flight: bound ceil(2 * 12 / 4) = 6
    assert decision.reason.endswith(
        f"sent to {home}, at 9 in flight, bound 6 -> {idlest} (least loaded)"
    )
    assert decision.reason.startswith("spill: longest prefix: ")


def test_spilled_follow_up_lives_on_where_it_went() -> None:
    """After a spill, the conversation's next turn follows the replica that took the last."""
    policy = LongestPrefix()
    messages = conversation(9)
    home = route(policy, chat(SYSTEM, messages[0]), FOUR)
    busy = [replica(r.id, 20 if r.id == home else 0) for r in FOUR]
    moved = route(policy, chat(SYSTEM, *messages[:3]), busy)
    assert moved != home
    assert policy.select(chat(SYSTEM, *messages[:5]), FOUR).replica == moved


def test_new_conversation_spills_down_the_rendezvous_ranking() -> None:
    """A new prefix whose home is over the bound goes to the next replica in its ranking."""
    policy = LongestPrefix()
    request = chat(SYSTEM, "fresh question")
    ranking = rendezvous_order(request.prefix_hashes[0], ["r1", "r2", "r3", "r4"])
    decision = policy.select(request, loaded(ranking[0], 3, 0))
    # total 3: bound ceil(1.25 * 4 / 4) = 2
    assert decision.replica == ranking[1]
    assert decision.candidates == (ranking[1], ranking[0], *ranking[2:])
    assert decision.reason.endswith(
        f", {ranking[0]} at 3 in flight, bound 2 -> {ranking[1]} (rank 2)"
    )


def test_follow_up_whose_replica_left_the_pool_goes_to_an_eligible_one() -> None:
    """A conversation whose replica is now drained is placed afresh, never on the drained one."""
    policy = LongestPrefix()
    messages = conversation(10)
    home = route(policy, chat(SYSTEM, messages[0]), FOUR)
    fleet = [replica(r.id, draining=r.id == home) for r in FOUR]
    decision = policy.select(chat(SYSTEM, *messages[:3]), fleet)
    assert decision.replica != home and home not in decision.candidates


def test_placements_expire_after_ttl() -> None:
    """A conversation idle past ttl_s is forgotten: its next turn is placed as new."""
    policy = LongestPrefix(ttl_s=60)
    messages = conversation(11)
    first = chat(SYSTEM, messages[0])
    policy.on_start("r3", first, 100.0)
    assert policy.select(chat(SYSTEM, *messages[:3]), FOUR).reason.startswith("longest prefix")
    policy.on_start("r1", chat("another system prompt entirely, " * 4, "x"), 161.0)
    assert policy.select(chat(SYSTEM, *messages[:3]), FOUR).reason.startswith("new prefix")


def test_prompt_without_a_full_block_goes_to_the_least_loaded() -> None:
    """Nothing to match: the least loaded replica, as prefix_affinity does."""
    fleet = [replica("r1", 2), replica("r2", 0), replica("r3", 1)]
    decision = LongestPrefix().select(features("short"), fleet)
    assert decision.replica == "r2"
    assert decision.reason.startswith("least_loaded fallback: prompt has no full block")


@pytest.mark.parametrize(
    "options",
    [{"load_factor": 0.9}, {"load_factor": 1.5, "follow_load_factor": 1.2}, {"max_entries": 0}],
)
def test_rejects_impossible_options(options: dict[str, float]) -> None:
    """Bounds below the mean, a follow bound tighter than the new one, or an empty index."""
    with pytest.raises(ValueError):
        make_policy("longest_prefix", **options)


fleets = st.lists(
    st.builds(
        ReplicaView,
        id=st.sampled_from(["r1", "r2", "r3", "r4", "r5"]),
        healthy=st.booleans(),
        leased=st.just(False),
        draining=st.booleans(),
        in_flight=st.integers(0, 20),
        capacity_weight=st.sampled_from([0.5, 1.0, 2.0]),
        production=st.booleans(),
    ),
    max_size=5,
    unique_by=lambda r: r.id,
)


@given(steps=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4), fleets), max_size=25))
def test_any_sequence_of_turns_gets_eligible_choices(
    steps: list[tuple[int, int, list[ReplicaView]]],
) -> None:
    """Whatever conversations, turns and fleets follow each other, every choice is eligible
    and the candidates are exactly the eligible replicas."""
    policy = LongestPrefix(max_entries=50)
    for conv, turns, fleet in steps:
        request = chat(SYSTEM, *conversation(conv)[: 2 * turns + 1])
        eligible = {r.id for r in fleet if r.production and r.healthy and not r.draining}
        try:
            decision = policy.select(request, fleet)
        except NoReplicaAvailable:
            assert not eligible
            continue
        assert decision.replica in eligible
        assert sorted(decision.candidates) == sorted(eligible)
        policy.on_start(decision.replica, request, 0.0)
        assert len(policy.index) <= 50
