"""The chain against a real redis-server: steps with their records, generations, what is known."""

from __future__ import annotations

import asyncio
import hashlib
import random
from datetime import UTC, datetime
from pathlib import Path

import orjson
import redis.asyncio as aioredis

from router.ledger.chain import RequestDigest, fold, genesis, request_digest, step, text_digest
from router.ledger.core import Fence
from router.ledger.records import stamp, template, with_chain
from tests.ledger_helpers import (
    ENGINE,
    any_client,
    client,
    fresh_chain,
    lineage,
    make_ledger,
    record,
)
from tests.servers import RedisServer

__all__ = ["any_client", "client"]  # the fixtures, used by name


def test_a_request_digest_hashed_in_two_halves_is_the_digest_of_the_whole() -> None:
    """The request's half is hashed while the replica works, the output's when it is known:
    the digest must still be SHA-256 of the canonical JSON of [model, prompt, params, output],
    or records written before and after that split would not chain alike."""
    params = {"top_k": 1, "max_tokens": 8, "stop": ["\n", "é"], "seed": None, "temperature": 0.5}
    for output in ["", "ok", 'a "quoted", [bracketed] answer', "über\u2028\ttabs", "]"]:
        whole = orjson.dumps(
            ["ensemble", 'say "hi"', params, output],
            option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS,
        )
        expected = hashlib.sha256(whole).hexdigest()
        assert request_digest("ensemble", 'say "hi"', params, output) == expected
        split = RequestDigest("ensemble", 'say "hi"', params)
        assert split.of(output) == expected
        assert split.of(output) == expected  # the request's half is not used up by the first
    moved = request_digest("ensemble", "pa", params, "")
    assert request_digest("ensemble", "p", params, "a") != moved


async def test_python_step_equals_lua_step(any_client: aioredis.Redis, tmp_path: Path) -> None:
    """The chain Redis computes is the chain anyone can recompute in Python from the digests."""
    ledger = make_ledger(any_client, tmp_path / "spool")
    head = await fresh_chain(ledger)
    assert head.state == genesis(ENGINE) and head.known
    records = [record(i, generation=head.generation) for i in range(20)]
    for r in records:
        done = await ledger.commit(r)
        assert done["state_after"] == step(done["state_before"], r["digest"])
        assert done["state_known"] is True and not done["stale"]
    final = await ledger.head("r1")
    assert final.state == fold(genesis(ENGINE), [r["digest"] for r in records])
    assert final.seq == 20


async def test_the_stored_record_is_the_answered_record(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """The record the client gets is, byte for byte, the one the step wrote into the stream."""
    ledger = make_ledger(client, tmp_path / "spool")
    head = await fresh_chain(ledger)
    data = template(record(1, generation=head.generation))
    answered = await ledger.commit(record(1, generation=head.generation))
    raw = (await client.xrange("kvl:{replica:r1}:lineage"))[0][1][b"r"]
    fields = {k: answered[k] for k in ("seq", "state_before", "state_after", "state_known")}
    fields.update(stale=False, unordered=False, exact=False)
    assert raw == with_chain(data, fields)
    assert orjson.loads(raw) == answered


async def test_a_replica_first_seen_has_an_unknown_state(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A chain the proxy did not see start empty is unknown: a state equal to no other, and
    records that say so; only a proven-empty cache starts at genesis."""
    ledger = make_ledger(client, tmp_path / "spool")
    warm = await ledger.ensure_replica("r1", ENGINE, proven_empty=False, counter=40)
    other = await ledger.ensure_replica("r2", ENGINE, proven_empty=False, counter=40)
    empty = await ledger.ensure_replica("r3", ENGINE, proven_empty=True, counter=0)
    assert not warm.known and not other.known and empty.known
    assert len({warm.state, other.state, empty.state, genesis(ENGINE)}) == 3
    assert empty.state == genesis(ENGINE)
    done = await ledger.commit(record(1, generation=warm.generation))
    assert done["state_known"] is False and done["state_before"] == warm.state
    events = await ledger.generations("r1")
    assert events[-1]["reason"] == "first seen" and events[-1]["known"] == "0"


async def test_generation_numbers_never_repeat_after_redis_lost_everything(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """After FLUSHALL a replica's chain starts again at a generation above every earlier one."""
    ledger = make_ledger(client, tmp_path / "spool")
    first = await fresh_chain(ledger)
    raised = await ledger.new_generation("r1", ENGINE, "verified reset", proven_empty=True)
    assert raised.generation == first.generation + 1
    # A new chain's generation is Redis' clock in ms and each change adds one: numbers stay
    # apart while changes come slower than one per ms. Two within the same ms (this test ran
    # in under 1 ms, about 1 run in 10) is not the case the design covers.
    await asyncio.sleep(0.01)
    await client.flushall()
    again = await ledger.ensure_replica("r1", ENGINE, proven_empty=False, counter=3)
    assert again.generation > raised.generation and not again.known


async def test_a_step_retried_moves_the_chain_and_writes_the_record_once(
    any_client: aioredis.Redis, tmp_path: Path
) -> None:
    """A retried step (its reply was lost) gets the first answer: one step, one stream entry."""
    ledger = make_ledger(any_client, tmp_path / "spool")
    head = await fresh_chain(ledger)
    first = await ledger.commit(record(7, generation=head.generation))
    second = await ledger.commit(record(7, generation=head.generation))
    assert second["state_after"] == first["state_after"] and second["seq"] == first["seq"] == 0
    assert len(await lineage(any_client)) == 1
    assert (await ledger.head("r1")).seq == 1


async def test_a_stale_generation_moves_nothing_and_claims_no_state(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A request of an ended generation leaves a record that says stale, with no state."""
    ledger = make_ledger(client, tmp_path / "spool")
    head = await fresh_chain(ledger)
    done = await ledger.commit(record(1, generation=head.generation - 1))
    assert done["stale"] and done["state_before"] is None and done["state_after"] is None
    assert done["exact"] is False
    assert await ledger.head("r1") == head


async def test_concurrent_proxies_keep_one_chain(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """Two proxy instances stepping one replica at once leave one unbroken chain of 100 steps."""
    other = aioredis.Redis.from_url(redis_server.url)
    ledgers = [make_ledger(client, tmp_path / "a"), make_ledger(other, tmp_path / "b")]
    head = await fresh_chain(ledgers[0])
    records = [record(i, generation=head.generation) for i in range(100)]
    done = await asyncio.gather(*(ledgers[i % 2].commit(r) for i, r in enumerate(records)))
    await other.aclose()
    by_seq = sorted(done, key=lambda r: r["seq"])
    assert [r["seq"] for r in by_seq] == list(range(100))
    for before, after in zip(by_seq, by_seq[1:], strict=False):
        assert after["state_before"] == before["state_after"]
    assert [r["request_id"] for r in await lineage(client)] == [r["request_id"] for r in by_seq]
    final = await ledgers[0].head("r1")
    assert final.state == fold(genesis(ENGINE), [r["digest"] for r in by_seq])


async def test_generations_say_why_and_whether_the_cache_was_seen_empty(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A reset restarts at genesis; an engine change or a counter below the generation's start
    (a restart nobody watched) start a new generation, unknown unless proven empty."""
    ledger = make_ledger(client, tmp_path / "spool")
    head = await ledger.ensure_replica("r1", ENGINE, proven_empty=False, counter=50)
    await ledger.commit(record(1, generation=head.generation))
    reset = await ledger.new_generation("r1", ENGINE, "verified reset", proven_empty=True)
    assert (reset.seq, reset.state, reset.known) == (0, genesis(ENGINE), True)
    changed = await ledger.ensure_replica("r1", "new engine", proven_empty=False, counter=9)
    assert not changed.known and changed.generation == reset.generation + 1
    same = await ledger.ensure_replica("r1", "new engine", proven_empty=False, counter=12)
    assert same == changed
    restarted = await ledger.ensure_replica("r1", "new engine", proven_empty=True, counter=0)
    assert restarted.generation == changed.generation + 1 and restarted.known
    events = await ledger.generations("r1")
    assert [e["reason"] for e in events] == [
        "first seen",
        "verified reset",
        "engine changed",
        "request counter below its value when the generation began: restart or reload",
    ]


async def test_a_fenced_step_that_lost_its_turn_is_unordered(
    any_client: aioredis.Redis, tmp_path: Path
) -> None:
    """An eval step whose turn expired still moves the chain, to a fresh unknown state, and its
    record says the order was lost; the next record descends from an unknown state."""
    ledger = make_ledger(any_client, tmp_path / "spool")
    gen = (await fresh_chain(ledger)).generation
    await any_client.set("kvl:{replica:r1}:turn", "7")
    held = await ledger.fenced_commit(record(1, generation=gen), Fence("7", "arm.1", 1))
    assert held["exact"] and not held["unordered"] and held["state_known"]
    lost = await ledger.fenced_commit(record(2, generation=gen), Fence("6", "arm.1", 2))
    assert lost["unordered"] and not lost["exact"]
    assert lost["state_after"] != step(lost["state_before"], record(2)["digest"])
    after = await ledger.commit(record(3, generation=gen))
    assert after["state_before"] == lost["state_after"] and after["state_known"] is False
    assert await any_client.hget("kvl:{replica:r1}:run", "count") == b"1"


async def test_redis_losing_the_chain_mid_traffic_marks_the_request_stale(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A step finding no chain (Redis flushed) starts an unknown chain and records the request
    stale: it claims no state, and says why."""
    ledger = make_ledger(client, tmp_path / "spool")
    head = await fresh_chain(ledger)
    await client.flushall()
    done = await ledger.commit(record(1, generation=head.generation))
    assert done["stale"] and done["state_before"] is None
    assert done["warning"] == "Redis lost its data"
    ((_, fields),) = await client.xrange("kvl:{replica:r1}:lineage")
    assert orjson.loads(fields[b"r"])["warning"] == "Redis lost its data"
    now = await ledger.head("r1")
    assert not now.known and now.generation > head.generation
    assert text_digest("x") != now.state


def test_record_times_read_as_isoformat_would_write_them() -> None:
    """A record's ``at`` (formatted once a second, the milliseconds added) is what
    ``datetime.isoformat`` gives, across seconds, days and years, in any order."""
    base = datetime(2026, 12, 31, 23, 59, 58, tzinfo=UTC).timestamp()
    moments = [base + s + us / 1e6 for s in (0, 1, 2, 1, 86_400) for us in (0, 1_000, 999_000)]
    moments += [base + 0.5 + n * 0.0123 for n in range(200)]
    draw = random.Random(7)
    moments += [draw.uniform(1e9, 4e9) for _ in range(5_000)]  # 2001 to 2096
    for now in moments:
        expected = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds")
        assert stamp(now) == expected, now
    assert stamp().startswith(str(datetime.now(UTC).year))
