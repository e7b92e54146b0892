"""Lineage records on their way to Redis: streams, outages, the spool, retries."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from router.ledger import (
    ChainHead,
    LedgerUnavailable,
    SpoolUnavailable,
)
from router.ledger.chain import fold, step
from tests.ledger_helpers import (
    ENGINE,
    client,
    lineage,
    make_ledger,
    record,
    spool_line,
    until,
    written,
)
from tests.servers import RedisServer

__all__ = ["client"]  # the fixture, used by name


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
