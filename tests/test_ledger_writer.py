"""Late chain steps and record indexes on their way to Redis: outages, the spool, retries."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from router.ledger import LedgerUnavailable, SpoolUnavailable
from router.ledger.chain import fold, step
from router.ledger.spool import Step, job_from_record
from tests.ledger_helpers import (
    ENGINE,
    client,
    fresh_chain,
    lineage,
    make_ledger,
    record,
    spool_line,
    until,
    written,
)
from tests.servers import RedisServer

__all__ = ["client"]  # the fixture, used by name


async def test_records_read_back_by_id_tail_and_run(client: aioredis.Redis, tmp_path: Path) -> None:
    """A record reads back by request id, in the tail (replicas merged in the order Redis wrote
    them) and in its run."""
    ledger = make_ledger(client, tmp_path / "spool")
    await ledger.start()
    await client.hset("kvl:replicas", mapping={"r1": b"{}", "r2": b"{}"})
    gens = {r: (await fresh_chain(ledger, r)).generation for r in ("r1", "r2")}
    done = []
    for i in range(6):
        replica = "r1" if i % 3 else "r2"
        rec = record(i, run="run-1" if i % 2 else None, replica=replica, generation=gens[replica])
        done.append(await ledger.commit(rec))
        await asyncio.sleep(0.002)  # the merge orders by Redis' clock, to the millisecond
    await until(written(ledger, 3))  # the run's index, behind; the rest went with each step
    assert await ledger.record("req-0003") == done[3]
    assert await ledger.record("missing") is None
    assert 0 < await client.ttl("kvl:{replica:r2}:req:req-0003") <= 7 * 24 * 3600
    assert await ledger.tail(4) == done[2:]
    assert await ledger.tail(10, replica="r2") == [done[0], done[3]]
    assert await ledger.run_records("run-1") == done[1::2]
    assert await ledger.tail(2, run="run-1") == done[3::2]
    await ledger.close()


async def test_outage_defers_then_steps_in_order(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """While Redis is down every request is answered pending and its step spooled; afterwards
    all 120 steps run in submit order, each record written once, chained from the head."""
    spool = tmp_path / "spool.jsonl"
    ledger = make_ledger(client, spool)
    await ledger.start()
    head = await fresh_chain(ledger)
    await client.hset("kvl:replicas", "r1", b"{}")
    await client.save()  # the restarted server loads this snapshot: the chain survives
    redis_server.stop()
    with pytest.raises(LedgerUnavailable):
        await ledger.head("r1")
    answered = [await ledger.commit(record(i, generation=head.generation)) for i in range(120)]
    assert all(r["pending"] and r["state_after"] is None for r in answered)
    await until(lambda: ledger.stats()["spooled"] == 120)
    redis_server.start()
    await until(written(ledger, 120))
    stored = await lineage(client)
    assert [r["request_id"] for r in stored] == [f"req-{i:04d}" for i in range(120)]
    state = head.state
    for i, r in enumerate(stored):
        assert r["pending"] and r["seq"] == i
        assert (r["state_before"], r["state_after"]) == (state, step(state, r["digest"]))
        state = r["state_after"]
    assert (await ledger.head("r1")).state == state
    assert await ledger.record("req-0119") == stored[-1]
    await until(lambda: ledger.stats()["spooled"] == 0)
    # The file is emptied just after the count drops (once a durable marker says so).
    await until(lambda: spool.stat().st_size == 0)
    await ledger.close()


async def test_spool_survives_a_restart(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path
) -> None:
    """Steps spooled by a proxy that stopped during an outage are run by the next one."""
    spool = tmp_path / "spool.jsonl"
    first = make_ledger(client, spool)
    await first.start()
    head = await fresh_chain(first)
    await client.save()
    redis_server.stop()
    for i in range(30):
        await first.commit(record(i, generation=head.generation))
    await first.close()
    assert len(spool.read_bytes().splitlines()) == 30
    redis_server.start()
    second = make_ledger(client, spool)
    await second.start()
    await until(written(second, 30))
    assert [r["seq"] for r in await lineage(client)] == list(range(30))
    await second.close()


async def test_full_buffer_keeps_order_and_steps_once(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A burst of late steps larger than the buffer is moved to disk, and still steps once
    each, in order."""
    ledger = make_ledger(client, tmp_path / "spool", buffer_size=8)
    await ledger.start()
    head = await fresh_chain(ledger)
    for i in range(300):
        ledger.defer(record(i, generation=head.generation), False, tried=False)
        if i == 3:
            await asyncio.sleep(0)  # the writer takes the first batch; the burst overflows
    await until(written(ledger, 300))
    assert ledger.stats()["spooled_total"] > 0
    assert [r["seq"] for r in await lineage(client)] == list(range(300))
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
            await ledger.commit(record(i))
        await until(lambda: ledger.stats()["dropped_total"] == 10)
    dropped = [e["request_id"] for e in logs if e["event"] == "ledger_record_dropped"]
    assert dropped == [f"req-{i:04d}" for i in range(10)]
    await ledger.close()


async def test_spool_resumes_at_its_marker(client: aioredis.Redis, tmp_path: Path) -> None:
    """After a crash the next proxy runs only the steps not run yet, and skips the half-written
    line the crash left at the end."""
    spool = tmp_path / "spool.jsonl"
    gen = (await fresh_chain(make_ledger(client, tmp_path / "other"))).generation
    lines = [spool_line(record(i, generation=gen)) for i in range(4)]
    spool.write_bytes(b"".join(lines) + b'{"step":null,"rec')
    (tmp_path / "spool.jsonl.done").write_text(str(len(lines[0])))
    ledger = make_ledger(client, spool)
    await ledger.start()
    await until(written(ledger, 3))
    assert [r["request_id"] for r in await lineage(client)] == ["req-0001", "req-0002", "req-0003"]
    await ledger.close()


async def test_a_spool_drained_twice_steps_and_writes_once(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A spool drained twice (a crash before its marker was saved) moves the chain once and
    leaves each record once in the replica's stream: exactly once, by the step keys."""
    spool = tmp_path / "spool.jsonl"
    head = await fresh_chain(make_ledger(client, tmp_path / "other"))
    lines = b"".join(spool_line(record(i, generation=head.generation)) for i in range(3))
    for _attempt in range(2):
        spool.write_bytes(lines)
        ledger = make_ledger(client, spool)
        await ledger.start()
        await until(written(ledger, 3))
        await ledger.close()
    stored = await lineage(client)
    assert [r["seq"] for r in stored] == [0, 1, 2]
    assert stored[-1]["state_after"] == fold(head.state, [r["digest"] for r in stored])
    assert (await ledger.head("r1")).seq == 3


async def test_one_spool_per_process(client: aioredis.Redis, tmp_path: Path) -> None:
    """Two ledgers cannot share a spool file: the second one fails to start, saying why."""
    first = make_ledger(client, tmp_path / "spool")
    await first.start()
    with pytest.raises(SpoolUnavailable, match="locked"):
        await make_ledger(client, tmp_path / "spool").start()
    await first.close()


async def test_a_step_whose_reply_was_lost_runs_once(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A step that ran but whose reply was lost, retried later from the spool, keeps its first
    answer: the chain moves once and the record is in the stream once."""
    ledger = make_ledger(client, tmp_path / "spool")
    await ledger.start()
    head = await fresh_chain(ledger)
    first = await ledger.commit(record(7, generation=head.generation))
    late = ledger.defer(record(7, generation=head.generation), False, tried=True)
    assert late["pending"]
    await until(written(ledger, 1))
    assert [r["request_id"] for r in await lineage(client)] == ["req-0007"]
    assert (await ledger.head("r1")).state == first["state_after"]
    await ledger.close()


@pytest.mark.parametrize("path", ["wire", "redis-py"])
async def test_a_commit_cancelled_on_its_way_is_still_recorded_once(
    client: aioredis.Redis, tmp_path: Path, path: str
) -> None:
    """A request whose client left while its step was on its way to Redis (here: Redis paused,
    the caller cancelled meanwhile) still leaves its record, once, and the next request chains
    after it: on the request path's wire (here the step script is not cached yet, so the
    command sent first only asks for it) and on redis-py (which drops a cancelled command's
    connection)."""
    ledger = make_ledger(client, tmp_path / "spool")
    await ledger.start()
    if path == "redis-py":
        ledger._wire = None  # as for a TLS or unix-socket Redis
    head = await fresh_chain(ledger)
    await client.execute_command("CLIENT", "PAUSE", 500, "ALL")
    task = asyncio.create_task(ledger.commit(record(1, generation=head.generation)))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stored: list[dict[str, object]] = []

    async def look() -> None:
        stored[:] = await lineage(client)

    for _ in range(250):
        await look()
        if stored:
            break
        await asyncio.sleep(0.02)
    # The writer may still be settling the first step: the second is then answered pending and
    # written behind it, in order.
    await ledger.commit(record(2, generation=head.generation))
    for _ in range(250):
        await look()
        if len(stored) >= 2:
            break
        await asyncio.sleep(0.02)
    assert [r["request_id"] for r in stored] == ["req-0001", "req-0002"]
    assert stored[0]["state_before"] == head.state
    assert stored[1]["state_before"] == stored[0]["state_after"]
    await ledger.close()


async def test_a_retry_too_late_to_be_sure_moves_to_an_unknown_state(
    client: aioredis.Redis, tmp_path: Path
) -> None:
    """A step sent without an answer longer ago than steps are remembered cannot know whether
    it ran: the chain moves to an unknown state and the record says unordered."""
    ledger = make_ledger(client, tmp_path / "spool")
    await ledger.start()
    head = await fresh_chain(ledger)
    rec = {**record(1, generation=head.generation), "pending": True}
    long_ago = int(time.time() * 1000) - 2 * 3600 * 1000
    stale_step = Step("r1", head.generation, rec["digest"], False, long_ago)
    ledger._writer.put(job_from_record(rec, orjson.dumps(rec), stale_step))
    await until(written(ledger, 1))
    (stored,) = await lineage(client)
    assert stored["unordered"] and stored["state_after"] != step(head.state, rec["digest"])
    assert not (await ledger.head("r1")).known
    await ledger.close()


def test_engine_digest_is_the_ledgers_engine() -> None:
    """The helpers' records carry the engine the chains are made for."""
    assert record(1)["engine_digest"] == ENGINE
