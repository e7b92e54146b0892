"""Eval mode's parts on their own: the turn queue and fence on a real Redis, profile checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from router.eval.heartbeat import heartbeat
from router.eval.profiles import ProfileError, check_fleet
from router.ledger.core import Fence
from router.ledger.keys import Profile
from router.ledger.schema import cache_key
from router.ledger.turns import TurnLost, Turns
from tests.ledger_helpers import make_ledger, record
from tests.servers import RedisServer

REGISTRY = {"r1": {"model": "ensemble", "reuse": True}, "r3": {"model": "ensemble", "reuse": False}}


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(redis_server.url)
    await redis.hset(cache_key("r1"), mapping={"generation": 1, "seq": 0, "state": "g"})
    try:
        yield redis
    finally:
        await redis.aclose()


@pytest.fixture
def turns(client: aioredis.Redis) -> Turns:
    return Turns(client)


async def test_turns_go_in_arrival_order_one_at_a_time(turns: Turns) -> None:
    """The first ticket gets the turn; the second waits until the first releases it."""
    first = await turns.enqueue("r1", 10_000)
    second = await turns.enqueue("r1", 10_000)
    assert await turns.try_acquire("r1", second, 10_000, 10_000) is None
    turn = await turns.try_acquire("r1", first, 10_000, 10_000)
    assert turn is not None
    assert await turns.try_acquire("r1", second, 10_000, 10_000) is None
    await turns.release("r1", first, turn.token)
    assert await turns.try_acquire("r1", second, 10_000, 10_000) is not None


async def test_a_dead_waiter_is_skipped_and_learns_it_lost(turns: Turns) -> None:
    """A ticket whose waiter stopped refreshing is dropped, so it cannot block the queue."""
    dead = await turns.enqueue("r1", 1)
    alive = await turns.enqueue("r1", 10_000)
    await asyncio.sleep(0.01)
    assert await turns.try_acquire("r1", alive, 10_000, 10_000) is not None
    with pytest.raises(TurnLost):
        await turns.try_acquire("r1", dead, 10_000, 10_000)


async def test_a_holder_whose_turn_expired_cannot_pass_its_step_as_ordered(
    turns: Turns, client: aioredis.Redis, tmp_path: Path
) -> None:
    """Fencing: after the turn expired and another request took it, the old token's step is
    recorded unordered (its place in the cache's order is lost); the holder's is ordered."""
    stale_ticket = await turns.enqueue("r1", 10_000)
    stale = await turns.try_acquire("r1", stale_ticket, 10_000, 20)
    assert stale is not None
    await asyncio.sleep(0.05)
    await turns.release("r1", stale_ticket)  # its waiter entry; the turn already expired
    fresh_ticket = await turns.enqueue("r1", 10_000)
    fresh = await turns.try_acquire("r1", fresh_ticket, 10_000, 10_000)
    assert fresh is not None
    ledger = make_ledger(client, tmp_path / "spool")
    late = await ledger.fenced_commit(record(1), Fence(stale.token, "run.1", 5))
    assert late["unordered"] and not late["exact"] and late["state_before"] == "g"
    ordered = await ledger.fenced_commit(record(2), Fence(fresh.token, "run.1", 6))
    assert not ordered["unordered"] and ordered["exact"] and ordered["seq"] == 1


async def test_a_reset_whose_owner_died_is_found_and_taken_over(turns: Turns) -> None:
    """A second reset is refused while one runs; once its owner's heartbeat stops, the reset is
    orphaned and exactly one other proxy takes it over."""
    assert await turns.begin_reset("r1", "proxy-a", 100, run="a.1", started="now") == ""
    assert await turns.begin_reset("r1", "proxy-b", 100, started="now") == "proxy-a"
    assert await turns.orphaned_resets(["r1"]) == []
    await asyncio.sleep(0.15)  # proxy-a died: nobody renews its mark
    assert await turns.orphaned_resets(["r1"]) == ["r1"]
    intent = await turns.take_over_reset("r1", "proxy-b", 10_000)
    assert intent["run"] == "a.1" and intent["dead_owner"] == "proxy-a"
    assert await turns.take_over_reset("r1", "proxy-c", 10_000) == {}
    await turns.end_reset("r1", "proxy-b")
    assert await turns.orphaned_resets(["r1"]) == [] and (await turns.marks(["r1"]))["r1"] == (
        None,
        False,
    )


async def test_a_failed_reset_leaves_its_intent_for_recovery_and_refuses_new_resets(
    turns: Turns,
) -> None:
    """A reset that failed with the model touched drops its mark but keeps its intent, saying
    why and without its run (its owner fails that): a monitor finds it at once, and a new reset
    is refused with the reason until the recovery ends it."""
    assert await turns.begin_reset("r1", "proxy-a", 10_000, run="a.1", started="now") == ""
    await turns.leave_reset("r1", "proxy-a", "unload took too long")
    assert await turns.orphaned_resets(["r1"]) == ["r1"]
    assert await turns.begin_reset("r1", "proxy-b", 100, started="now") == "!unload took too long"
    intent = await turns.take_over_reset("r1", "proxy-b", 10_000)
    assert intent["failed"] == "unload took too long" and intent["run"] == ""
    await turns.end_reset("r1", "proxy-b")
    assert await turns.orphaned_resets(["r1"]) == []
    assert await turns.begin_reset("r1", "proxy-b", 100, started="now") == ""


async def test_a_heartbeat_reports_the_claim_it_lost() -> None:
    """A renewal that finds the claim gone (or Redis away) is remembered for the holder."""
    answers = iter([None, "taken over"])

    async def renew() -> str | None:
        return next(answers)

    async with heartbeat(renew, 0.01) as beat:
        await asyncio.sleep(0.1)
    assert beat.lost == "taken over"


async def test_a_lease_is_exclusive_until_freed(turns: Turns) -> None:
    """Only one run can hold a replica; freeing needs the holder's name."""
    assert await turns.take_lease("r1", "a.1", 10_000) is None
    assert await turns.take_lease("r1", "b.1", 10_000) == "a.1"
    assert not await turns.free_lease("r1", "b.1")
    assert await turns.free_lease("r1", "a.1")
    assert (await turns.marks(["r1"]))["r1"] == (None, False)


@pytest.mark.parametrize(
    ("profile", "registry", "snapshot", "error"),
    [
        (Profile("a", "eval", cache="off"), {"r1": REGISTRY["r1"]}, False, "reuse disabled"),
        (Profile("a", "eval", cache="off"), {}, False, "start the proxy first"),
        (Profile("a", "eval", cache="reset", replica="r3"), REGISTRY, False, "reuse off"),
        (Profile("a", "eval", cache="reset", replica="r9"), REGISTRY, False, "no replica 'r9'"),
        (Profile("a", "eval", cache="replay:s"), REGISTRY, False, "snapshot 's' does not exist"),
    ],
)
def test_profiles_the_fleet_cannot_serve_are_refused(
    profile: Profile, registry: dict[str, dict[str, object]], snapshot: bool, error: str
) -> None:
    """An eval key the fleet cannot serve is refused with a message saying why."""
    with pytest.raises(ProfileError, match=error):
        check_fleet(profile, registry, snapshot)


def test_profiles_the_fleet_can_serve_pass() -> None:
    """Off with a reuse-off replica, a suitable pinned replica, an existing snapshot: accepted."""
    check_fleet(Profile("a", "eval", cache="off"), REGISTRY, False)
    check_fleet(Profile("a", "eval", cache="off", replica="r3"), REGISTRY, False)
    check_fleet(Profile("a", "eval", cache="replay:s"), REGISTRY, True)
    check_fleet(Profile("a"), {}, False)
