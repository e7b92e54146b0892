"""The chain against a real redis-server: steps, genesis, generations, concurrent proxies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from router.ledger import (
    ChainHead,
)
from router.ledger.chain import fold, genesis, step, text_digest
from tests.ledger_helpers import ENGINE, client, make_ledger
from tests.servers import RedisServer

__all__ = ["client"]  # the fixture, used by name


async def test_python_step_equals_lua_step(client: aioredis.Redis, tmp_path: Path) -> None:
    """The chain Redis computes is the chain anyone can recompute in Python from the digests."""
    ledger = make_ledger(client, tmp_path / "spool")
    digests = [text_digest(str(i)) for i in range(20)] + ["not-hex é|ü", ""]
    head = await ledger.ensure_replica("r1", ENGINE)
    assert head.state == genesis(ENGINE)
    for digest in digests:
        moved = await ledger.advance("r1", head.generation, digest)
        assert moved.state_after == step(moved.state_before, digest)
    assert (await ledger.head("r1")).state == fold(genesis(ENGINE), digests)


async def test_genesis_is_the_same_on_every_replica(client: aioredis.Redis, tmp_path: Path) -> None:
    """Fresh caches of identical engines compare equal, whatever the replica or generation."""
    ledger = make_ledger(client, tmp_path / "spool")
    first = await ledger.ensure_replica("r1", ENGINE)
    await ledger.new_generation("r2", ENGINE, "reset")
    second = await ledger.new_generation("r2", ENGINE, "reset")
    assert second.generation == 2
    assert first.state == second.state == genesis(ENGINE) != genesis("other engine")


async def test_advance_moves_by_one_and_ignores_stale(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """Each step raises seq by one from where the last ended; an old generation moves nothing."""
    ledger = make_ledger(client, tmp_path / "spool")
    head = await ledger.ensure_replica("r1", ENGINE)
    one = await ledger.advance("r1", head.generation, "d1")
    two = await ledger.advance("r1", head.generation, "d2")
    assert (one.seq, two.seq) == (1, 2)
    assert two.state_before == one.state_after and not one.stale and not two.stale
    stale = await ledger.advance("r1", head.generation + 1, "d3")
    assert stale.stale and stale.seq == 2 and stale.state_after == two.state_after
    assert await ledger.head("r1") == ChainHead("r1", 1, 2, two.state_after, ENGINE)


async def test_concurrent_proxies_keep_one_chain(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """Two proxy instances stepping one replica at once leave one unbroken chain of 100 steps."""
    other = aioredis.Redis.from_url(redis_server.url)
    ledgers = [make_ledger(client, tmp_path / "a"), make_ledger(other, tmp_path / "b")]
    head = await ledgers[0].ensure_replica("r1", ENGINE)
    digests = [text_digest(f"request {i}") for i in range(100)]
    steps = await asyncio.gather(
        *(ledgers[i % 2].advance("r1", head.generation, d) for i, d in enumerate(digests))
    )
    await other.aclose()
    by_seq = sorted(zip(steps, digests, strict=True), key=lambda pair: pair[0].seq)
    assert [s.seq for s, _ in by_seq] == list(range(1, 101))
    for (before, _), (after, _) in zip(by_seq, by_seq[1:], strict=False):
        assert after.state_before == before.state_after
    final = await ledgers[0].head("r1")
    assert final.seq == 100
    assert final.state == fold(genesis(ENGINE), [d for _, d in by_seq])


async def test_new_generation_resets_and_is_logged(client: aioredis.Redis, tmp_path: Path) -> None:
    """A reset raises the generation, restarts the chain at genesis and says why in the log."""
    ledger = make_ledger(client, tmp_path / "spool")
    head = await ledger.ensure_replica("r1", ENGINE)
    await ledger.advance("r1", head.generation, "d1")
    reset = await ledger.new_generation("r1", ENGINE, "verified reset")
    assert (reset.generation, reset.seq, reset.state) == (2, 0, genesis(ENGINE))
    assert await ledger.head("r1") == reset
    changed = await ledger.ensure_replica("r1", "new engine")
    assert (changed.generation, changed.state) == (3, genesis("new engine"))
    events = await ledger.generations("r1")
    assert [(e["generation"], e["reason"]) for e in events] == [
        (1, "first seen"),
        (2, "verified reset"),
        (3, "engine changed"),
    ]
