"""The ledger against a real redis-server: chain steps, generations, lineage, and outages."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
import structlog
from structlog.testing import capture_logs

from router.ledger import (
    ChainHead,
    Ledger,
    LedgerConfig,
    LedgerUnavailable,
    SpoolUnavailable,
)
from router.ledger.chain import fold, genesis, request_digest, step, text_digest
from tests.servers import RedisServer

ENGINE = "trtllm-0.13|ensemble|v1"


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(
        redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    yield redis
    await redis.aclose()


def make_ledger(redis: aioredis.Redis, spool: Path, **config: Any) -> Ledger:
    cfg = LedgerConfig(spool_path=spool, retry_interval_s=0.1, close_timeout_s=2.0, **config)
    return Ledger(redis, cfg, structlog.get_logger("kvledger.ledger"))


def record(i: int, *, run: str | None = None, generation: int = 1) -> dict[str, Any]:
    output = f"answer {i}"
    return {
        "request_id": f"req-{i:04d}",
        "replica": "r1",
        "generation": generation,
        "run": run,
        "seq": None,
        "state_before": None,
        "state_after": None,
        "pending": False,
        "digest": request_digest("ensemble", f"prompt {i}", {"seed": i}, output),
        "output_digest": text_digest(output),
        "status": "ok",
    }


def spool_line(rec: dict[str, Any], *, pending: bool = False) -> bytes:
    """One line of the documented spool format."""
    step = None
    if pending:
        rec = {**rec, "pending": True}
        step = {"replica": rec["replica"], "generation": rec["generation"], "digest": rec["digest"]}
    return orjson.dumps({"step": step, "record": rec}) + b"\n"


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll: the writer works in the background, and tests wait for what it did, boundedly."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not reached within {timeout_s} s")


def written(ledger: Ledger, count: int) -> Callable[[], bool]:
    return lambda: bool(ledger.stats()["written_total"] == count)


async def lineage(redis: aioredis.Redis) -> list[dict[str, Any]]:
    """Every record in kvl:lineage as stored, repeats included."""
    entries: list[Any] = await redis.xrange("kvl:lineage") or []
    return [orjson.loads(fields[b"r"]) for _id, fields in entries]


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


async def test_records_land_in_every_stream(client: aioredis.Redis, tmp_path: Path) -> None:
    """A submitted record can be read back by request id, in the lineage tail and in its run."""
    ledger = make_ledger(client, tmp_path / "spool")
    await ledger.start()
    records = [record(i, run="run-1" if i % 2 else None) for i in range(6)]
    for r in records:
        ledger.submit(r)
    await until(written(ledger, 6))
    assert await ledger.record("req-0003") == records[3]
    assert await ledger.record("missing") is None
    assert 0 < await client.ttl("kvl:req:req-0003") <= 7 * 24 * 3600
    assert await lineage(client) == records
    assert await ledger.tail(4) == records[2:]
    assert await ledger.run_records("run-1") == records[1::2]
    assert await ledger.tail(2, run="run-1") == records[3::2]
    await ledger.close()


async def test_outage_spools_then_drains_in_order(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """While Redis is down nothing fails and records are spooled; afterwards all 200 are written
    in submit order, and the late chain steps ran in that order."""
    spool = tmp_path / "spool.jsonl"
    ledger = make_ledger(client, spool)
    await ledger.start()
    head = await ledger.ensure_replica("r1", ENGINE)
    await client.save()  # the restarted server loads this snapshot: the chain survives
    redis_server.stop()
    with pytest.raises(LedgerUnavailable):
        await ledger.head("r1")
    for i in range(200):
        (ledger.submit_pending if i % 4 == 0 else ledger.submit)(record(i))
    await until(lambda: ledger.stats()["spooled"] == 200)
    assert not ledger.redis_up
    spooled = [
        orjson.loads(line)["record"]["request_id"] for line in spool.read_bytes().splitlines()
    ]
    assert spooled == [f"req-{i:04d}" for i in range(200)]
    redis_server.start()
    await until(written(ledger, 200))
    stored = await lineage(client)
    assert [r["request_id"] for r in stored] == [f"req-{i:04d}" for i in range(200)]
    late = [r for r in stored if r["pending"]]
    assert [r["seq"] for r in late] == list(range(50))
    state = head.state
    for r in late:
        assert (r["state_before"], r["state_after"]) == (state, step(state, r["digest"]))
        state = r["state_after"]
    assert (await ledger.head("r1")).state == state
    await until(lambda: ledger.stats()["spooled"] == 0)
    assert spool.stat().st_size == 0
    await ledger.close()


async def test_spool_survives_a_restart(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """Records spooled by a proxy that stopped during an outage are stored by the next one."""
    spool = tmp_path / "spool.jsonl"
    first = make_ledger(client, spool)
    await first.start()
    redis_server.stop()
    records = [record(i) for i in range(30)]
    for r in records:
        first.submit(r)
    await first.close()
    assert len(spool.read_bytes().splitlines()) == 30
    redis_server.start()
    second = make_ledger(client, spool)
    await second.start()
    await until(written(second, 30))
    assert await lineage(client) == records
    await second.close()


async def test_full_buffer_keeps_order_and_writes_once(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A burst larger than the buffer is moved to disk, and still written once each, in order."""
    ledger = make_ledger(client, tmp_path / "spool", buffer_size=8)
    await ledger.start()
    records = [record(i) for i in range(300)]
    for r in records[:4]:
        ledger.submit(r)
    await asyncio.sleep(0)  # the writer takes the first batch; the burst overflows behind it
    for r in records[4:]:
        ledger.submit(r)
    await until(written(ledger, 300))
    assert ledger.stats()["spooled_total"] > 0
    assert await lineage(client) == records
    await ledger.close()


async def test_spool_disk_failure_drops_and_counts(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """When the spool's disk is full, records are dropped, counted and logged, never raised."""
    spool = tmp_path / "spool.jsonl"
    os.symlink("/dev/full", spool)  # every write fails with ENOSPC
    ledger = make_ledger(client, spool)
    await ledger.start()
    redis_server.stop()
    with capture_logs() as logs:
        for i in range(10):
            ledger.submit(record(i))
        await until(lambda: ledger.stats()["dropped_total"] == 10)
    dropped = [e["request_id"] for e in logs if e["event"] == "ledger_record_dropped"]
    assert dropped == [f"req-{i:04d}" for i in range(10)]
    await ledger.close()


async def test_spool_resumes_at_its_marker(client: aioredis.Redis, tmp_path: Path) -> None:
    """After a crash the next proxy writes only what was not written yet, and skips the
    half-written line the crash left at the end."""
    spool = tmp_path / "spool.jsonl"
    records = [record(i) for i in range(4)]
    lines = [spool_line(r) for r in records]
    spool.write_bytes(b"".join(lines) + b'{"step":null,"rec')
    (tmp_path / "spool.jsonl.done").write_text(str(len(lines[0])))
    ledger = make_ledger(client, spool)
    await ledger.start()
    await until(written(ledger, 3))
    assert await lineage(client) == records[1:]
    await ledger.close()


async def test_replayed_spool_steps_the_chain_once(client: aioredis.Redis, tmp_path: Path) -> None:
    """A spool drained twice (a crash before its marker was saved) moves the chain once, and
    readers see each record once."""
    spool = tmp_path / "spool.jsonl"
    head = await make_ledger(client, tmp_path / "other").ensure_replica("r1", ENGINE)
    lines = b"".join(spool_line(record(i), pending=True) for i in range(3))
    for _attempt in range(2):
        spool.write_bytes(lines)
        ledger = make_ledger(client, spool)
        await ledger.start()
        await until(written(ledger, 3))
        await ledger.close()
    assert await client.xlen("kvl:lineage") == 6
    tail = await ledger.tail(10)
    assert [r["request_id"] for r in tail] == ["req-0000", "req-0001", "req-0002"]
    assert [r["seq"] for r in tail] == [0, 1, 2]
    digests = [r["digest"] for r in tail]
    assert tail[-1]["state_after"] == fold(head.state, digests)
    assert await ledger.head("r1") == ChainHead("r1", 1, 3, fold(head.state, digests), ENGINE)


async def test_one_spool_per_process(client: aioredis.Redis, tmp_path: Path) -> None:
    """Two ledgers cannot share a spool file: the second one fails to start, saying why."""
    first = make_ledger(client, tmp_path / "spool")
    await first.start()
    with pytest.raises(SpoolUnavailable, match="locked"):
        await make_ledger(client, tmp_path / "spool").start()
    await first.close()


async def test_retried_step_moves_the_chain_once(client: aioredis.Redis, tmp_path: Path) -> None:
    """A step whose reply was lost and that is retried late (as a pending record) keeps its
    first answer, and the chain moves once."""
    ledger = make_ledger(client, tmp_path / "spool")
    await ledger.start()
    head = await ledger.ensure_replica("r1", ENGINE)
    rec = record(7)
    first = await ledger.advance("r1", 1, rec["digest"], request_id=rec["request_id"])
    assert await ledger.advance("r1", 1, rec["digest"], request_id=rec["request_id"]) == first
    ledger.submit_pending(rec)
    await until(written(ledger, 1))
    stored = await ledger.record(rec["request_id"])
    assert stored is not None and stored["pending"]
    assert (stored["seq"], stored["state_before"], stored["state_after"]) == (
        0,
        head.state,
        first.state_after,
    )
    assert (await ledger.head("r1")).seq == 1
    await ledger.close()
