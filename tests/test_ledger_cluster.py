"""The ledger on a real Redis Cluster (3 masters, 1 replica each): the chain step goes to the
master that owns its replica's slot and follows the cluster when a slot moves (MOVED), is
migrating (ASK) or is half migrated (TRYAGAIN)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from router.ledger import Ledger
from router.ledger.chain import fold, genesis
from router.ledger.cluster_wire import ClusterWire
from router.ledger.connect import cluster_url, connect, is_cluster, parse_cluster_url
from router.ledger.core import Fence
from router.settings import SettingsError, build_settings
from tests.ledger_helpers import ENGINE, fresh_chain, make_ledger, record, until
from tests.servers import ClusterNode, LocalCluster, RedisReplica, RedisServer

Record = dict[str, object]

STEP_TIMEOUT_S = 5.0  # generous: a slot migration in the middle of a step takes a few turns


@pytest.fixture
async def cluster_client(redis_cluster: LocalCluster) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_cluster.url, timeout_s=2.0, connect_timeout_s=2.0)
    await client.flushall(target_nodes="primaries")  # type: ignore[call-arg]
    yield client
    await client.aclose()


@pytest.fixture
def ledger_on_cluster(cluster_client: aioredis.Redis, tmp_path: Path) -> Iterator[Ledger]:
    ledger = make_ledger(cluster_client, tmp_path / "spool", redis_timeout_s=STEP_TIMEOUT_S)
    yield ledger


def _sync(node: ClusterNode) -> redis.Redis:
    return redis.Redis(port=node.port, socket_timeout=5)


def _id(node: ClusterNode) -> str:
    with _sync(node) as r:
        return str(r.execute_command("CLUSTER", "MYID").decode())


def _masters(cluster: LocalCluster) -> list[ClusterNode]:
    out = []
    for node in cluster.nodes:
        with _sync(node) as r:
            if r.info("replication")["role"] == "master":
                out.append(node)
    return out


def _slot(key: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(key.encode()))


def _begin_migration(source: ClusterNode, target: ClusterNode, slot: int) -> None:
    with _sync(target) as t:
        t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _id(source))
    with _sync(source) as s:
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _id(target))


def _move_keys(source: ClusterNode, target: ClusterNode, keys: list[bytes]) -> None:
    if keys:
        with _sync(source) as s:
            s.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)


def _slot_keys(node: ClusterNode, slot: int) -> list[bytes]:
    with _sync(node) as r:
        return list(r.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000))


def _end_migration(cluster: LocalCluster, target: ClusterNode, slot: int) -> None:
    owner = _id(target)
    for node in [target, *(n for n in _masters(cluster) if n is not target)]:
        with _sync(node) as r:
            r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)


def _another_master(cluster: LocalCluster, node: ClusterNode) -> ClusterNode:
    return next(n for n in _masters(cluster) if n.port != node.port)


def test_a_cluster_is_chosen_by_its_url_or_by_one_setting() -> None:
    """``redis+cluster://h:p,h:p`` names the nodes; ``[server] redis_cluster = true`` turns a
    plain redis:// URL into that form; a database other than 0 is refused (clusters have one)."""
    nodes, user, password = parse_cluster_url("redis+cluster://u:p%40ss@10.0.0.1:7000,h2:7001")
    assert nodes == [("10.0.0.1", 7000), ("h2", 7001)] and (user, password) == ("u", "p@ss")
    assert cluster_url("redis://h:7000/0") == "redis+cluster://h:7000"
    replica = {"id": "r1", "grpc": "127.0.0.1:8001", "metrics": "http://127.0.0.1:8002/metrics"}
    raw = {"server": {"redis_url": "redis://h:7000", "redis_cluster": True}, "replicas": [replica]}
    settings = build_settings(raw, {}, Path("."))
    assert settings.redis_url == "redis+cluster://h:7000"
    raw["server"]["redis_url"] = "redis://h:7000/2"
    with pytest.raises(SettingsError, match="only database 0"):
        build_settings(raw, {}, Path("."))
    with pytest.raises(ValueError, match="bad cluster node"):
        parse_cluster_url("redis+cluster://h:notaport")


async def test_each_replicas_chain_lives_on_the_master_that_owns_its_slot(
    redis_cluster: LocalCluster, cluster_client: aioredis.Redis, ledger_on_cluster: Ledger
) -> None:
    """Six replicas' chains spread over the masters; each stream is on its slot's master, and
    reading the lineage back (the tail, the audit) merges the streams of every master."""
    assert is_cluster(cluster_client)
    replicas = [f"r{i}" for i in range(1, 7)]
    done = []
    for replica in replicas:
        head = await fresh_chain(ledger_on_cluster, replica)
        for i in range(3):
            done.append(
                await ledger_on_cluster.commit(
                    record(i, generation=head.generation, replica=replica)
                    | {"request_id": f"{replica}-{i}"}
                )
            )
    assert all(not r["pending"] for r in done)
    homes = set()
    for replica in replicas:
        stream = f"kvl:{{replica:{replica}}}:lineage"
        home = redis_cluster.master_of(stream)
        homes.add(home.port)
        with _sync(home) as r:
            assert r.xlen(stream) == 3
    assert len(homes) > 1  # the chains are spread, not on one node
    await cluster_client.hset("kvl:replicas", mapping={r: "{}" for r in replicas})
    tail = await ledger_on_cluster.tail(count=100)
    assert sorted(r["request_id"] for r in tail) == sorted(r["request_id"] for r in done)
    audits = await ledger_on_cluster.audit()
    assert [a.replica for a in audits] == replicas
    assert all(a.ok and a.records == 3 for a in audits)
    await ledger_on_cluster.close()


async def test_a_moved_slot_is_followed_and_the_chain_goes_on(
    redis_cluster: LocalCluster, cluster_client: aioredis.Redis, ledger_on_cluster: Ledger
) -> None:
    """The replica's slot moves to another master between two steps: the step is redirected
    (MOVED), the map read again, and the chain continues from where it was."""
    ledger = ledger_on_cluster
    head = await fresh_chain(ledger, "moved")
    first = await ledger.commit(record(1, generation=head.generation, replica="moved"))
    key = "kvl:{replica:moved}:cache"
    source = redis_cluster.master_of(key)
    target = _another_master(redis_cluster, source)
    slot = _slot(key)
    _begin_migration(source, target, slot)
    _move_keys(source, target, _slot_keys(source, slot))
    _end_migration(redis_cluster, target, slot)
    second = await ledger.commit(record(2, generation=head.generation, replica="moved"))
    assert not second["pending"] and second["seq"] == 1
    assert second["state_before"] == first["state_after"]
    wire = ledger._wire
    assert isinstance(wire, ClusterWire) and wire.redirections >= 1
    assert wire.owner(key) == ("127.0.0.1", target.port)
    assert redis_cluster.master_of(key).port == target.port
    with _sync(target) as r:
        assert r.xlen("kvl:{replica:moved}:lineage") == 2
    await ledger.close()


async def test_a_migrating_slot_is_asked_and_the_step_lands_when_it_ends(
    redis_cluster: LocalCluster, cluster_client: aioredis.Redis, ledger_on_cluster: Ledger
) -> None:
    """While the replica's slot migrates with its keys already on the target, the source answers
    ASK; the target (ASKING, then the script) refuses a script that creates keys there
    (TRYAGAIN): the step is retried, neither failed nor spooled, and lands once the migration
    ends, the chain unbroken and nothing written on the source."""
    ledger = ledger_on_cluster
    head = await fresh_chain(ledger, "asked")
    first = await ledger.commit(record(1, generation=head.generation, replica="asked"))
    key = "kvl:{replica:asked}:cache"
    source = redis_cluster.master_of(key)
    target = _another_master(redis_cluster, source)
    slot = _slot(key)
    _begin_migration(source, target, slot)
    try:
        _move_keys(source, target, _slot_keys(source, slot))
        step = asyncio.ensure_future(
            ledger.commit(record(2, generation=head.generation, replica="asked"))
        )
        await asyncio.sleep(0.3)
        assert not step.done()  # retrying, not failed, not spooled
        wire = ledger._wire
        assert isinstance(wire, ClusterWire) and wire.redirections >= 1  # the ASK followed
        assert wire.owner(key) == ("127.0.0.1", source.port)  # ASK does not change the map
    finally:
        _end_migration(redis_cluster, target, slot)
    second = await asyncio.wait_for(step, STEP_TIMEOUT_S * 2)
    assert not second["pending"] and second["seq"] == 1
    assert second["state_before"] == first["state_after"]
    assert _slot_keys(source, slot) == []
    with _sync(target) as r:
        assert r.xlen("kvl:{replica:asked}:lineage") == 2
    await ledger.close()


async def test_a_half_migrated_slot_is_retried_until_it_settles(
    redis_cluster: LocalCluster, cluster_client: aioredis.Redis, ledger_on_cluster: Ledger
) -> None:
    """Only some of the replica's keys have moved: the source answers TRYAGAIN; the step is
    retried within its deadline, and lands once the migration ends (then MOVED)."""
    ledger = ledger_on_cluster
    head = await fresh_chain(ledger, "half")
    first = await ledger.commit(record(1, generation=head.generation, replica="half"))
    key = "kvl:{replica:half}:cache"
    source = redis_cluster.master_of(key)
    target = _another_master(redis_cluster, source)
    slot = _slot(key)
    _begin_migration(source, target, slot)
    _move_keys(source, target, [key.encode()])  # the chain moved, its stream not yet
    step = asyncio.ensure_future(
        ledger.commit(record(2, generation=head.generation, replica="half"))
    )
    await asyncio.sleep(0.3)
    assert not step.done()  # retrying, not failed, not spooled
    _move_keys(source, target, _slot_keys(source, slot))
    _end_migration(redis_cluster, target, slot)
    second = await asyncio.wait_for(step, STEP_TIMEOUT_S * 2)
    assert not second["pending"] and second["seq"] == 1
    assert second["state_before"] == first["state_after"]
    final = await ledger.head("half")
    assert final.state == fold(genesis(ENGINE), [first["digest"], second["digest"]])
    await ledger.close()


# Durable eval records (WAIT) ----------------------------------------------------------------


async def _eval_step(ledger: Ledger, client: aioredis.Redis, i: int, head_gen: int) -> Record:
    """An eval request's fenced chain step, under a turn the test holds."""
    await client.set("kvl:{replica:r1}:turn", "token-1")
    rec = record(i, generation=head_gen, run="run-1")
    return await ledger.fenced_commit(rec, Fence("token-1", "run-1", i + 1))


async def _run_index(client: aioredis.Redis) -> list[dict[str, object]]:
    entries = await client.xrange("kvl:{run:run-1}:lineage") or []
    return [orjson.loads(fields[b"r"]) for _id, fields in entries]


async def test_an_eval_record_acknowledged_by_a_replica_is_durable_and_says_so(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """One node with a replica: an eval step is followed by WAIT; the record answered and the
    run's index say ``durable: true``. The replica gone, the WAIT times out: ``durable: false``.
    A production step sends no WAIT (``production_wait_ms`` 0) and its record has no field."""
    replica = RedisReplica(redis_server.port)
    replica.start()
    client = connect(redis_server.url, timeout_s=5.0, connect_timeout_s=2.0)
    ledger = make_ledger(client, tmp_path / "spool", redis_timeout_s=5.0, durable_wait_ms=1000)
    try:
        await ledger.start()
        head = await fresh_chain(ledger)
        done = await _eval_step(ledger, client, 1, head.generation)
        assert done["durable"] is True and not done["pending"]
        production = await ledger.commit(record(2, generation=head.generation))
        assert "durable" not in production
        replica.close()
        for _ in range(200):  # the master notices its replica is gone
            if (await client.info("replication"))["connected_slaves"] == 0:
                break
            await asyncio.sleep(0.05)
        late = await _eval_step(ledger, client, 3, head.generation)
        assert late["durable"] is False and not late["pending"] and late["seq"] == 2
        await until(lambda: ledger.stats()["written_total"] >= 2)
        index = await _run_index(client)
        assert [(r["request_id"], r["durable"]) for r in index] == [
            ("req-0001", True),
            ("req-0003", False),
        ]
    finally:
        replica.close()
        await ledger.close()
        await client.aclose()


async def test_without_a_replica_no_wait_is_sent_and_records_are_unchanged(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """One node, no replica: durability cannot be had, so no WAIT (it could only time out)
    and the record is exactly what it was before durability existed (no ``durable`` field)."""
    client = connect(redis_server.url, timeout_s=5.0, connect_timeout_s=2.0)
    ledger = make_ledger(client, tmp_path / "spool", redis_timeout_s=5.0, durable_wait_ms=1000)
    try:
        await ledger.start()
        head = await fresh_chain(ledger)
        done = await _eval_step(ledger, client, 1, head.generation)
        assert "durable" not in done and not done["pending"]
    finally:
        await ledger.close()
        await client.aclose()


async def test_an_eval_record_on_the_cluster_is_durable_on_two_nodes(
    redis_cluster: LocalCluster, cluster_client: aioredis.Redis, tmp_path: Path
) -> None:
    """On the cluster, the slot map lists the master's replica: the eval step's WAIT goes to
    the master that took the step, and the record is on its replica when the answer leaves."""
    ledger = make_ledger(
        cluster_client, tmp_path / "spool", redis_timeout_s=STEP_TIMEOUT_S, durable_wait_ms=2000
    )
    try:
        await ledger.start()
        head = await fresh_chain(ledger)
        done = await _eval_step(ledger, cluster_client, 1, head.generation)
        assert done["durable"] is True
        master = redis_cluster.master_of("kvl:{replica:r1}:lineage")
        with _sync(master) as r:
            info = r.info("replication")
        replica_port = int(info["slave0"]["port"])
        with redis.Redis(port=replica_port) as r:
            assert r.execute_command("READONLY") in (b"OK", True, "OK")
            assert r.xlen("kvl:{replica:r1}:lineage") == 1
    finally:
        await ledger.close()
