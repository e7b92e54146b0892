"""Failover under traffic: two proxies on a 3-master Redis Cluster (1 replica each), production
traffic and two eval runs; the master that owns r1's slot is killed (kill -9). After its replica
is promoted and the proxies' spools drained, nothing answered is lost or doubled, the chains
hold, the eval run on a shard that did not fail stayed durable and unbroken, and the eval run
on the failed shard either kept one durable, unbroken chain or broke with the reason: never a
silent fork."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import urllib3
from redis.cluster import ClusterNode as SyncNode
from redis.cluster import RedisCluster

from backends.sim.launcher import Replica, ReplicaSpec, free_ports, launch
from bench.workload import DEFAULT_MAX_TOKENS, Episode, make_episodes
from tests.eval_helpers import admin, begin, chained, cli, client, complete, end
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import LocalCluster, RedisReplica, RedisServer
from tests.test_compose import BASE, active_services, needs_compose, project
from tests.test_up import chat

__all__ = ["project"]  # the fixture, used by name

EPISODES = make_episodes(80)[:8]
WAIT_MS = 1000  # production and eval steps wait this long for the replica's acknowledgement
HTTP = urllib3.PoolManager(maxsize=8)


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A cluster of its own: this test kills one of its masters."""
    local = LocalCluster(3, 1, node_timeout_ms=1000)
    local.start()
    try:
        yield local
    finally:
        local.close()


def _proxy(replicas: dict[str, Replica], url: str) -> Proxy:
    proxy = Proxy(list(replicas.values()), url, extra=f"\n[eval]\ndurable_wait_ms = {WAIT_MS}\n")
    # Production steps WAIT too here, so that a record answered durable has a second copy.
    text = proxy.config.read_text()
    proxy.config.write_text(
        text.replace("[lineage]\n", f"[lineage]\nproduction_wait_ms = {WAIT_MS}\n", 1)
    )
    return proxy


def _complete(proxy: Proxy, key: str, prompt: str) -> dict[str, Any] | None:
    """One production completion's kvledger record; None when it was not answered 200."""
    body = orjson.dumps({"model": "ensemble", "prompt": prompt, "max_tokens": DEFAULT_MAX_TOKENS})
    response = HTTP.request(
        "POST",
        proxy.url + "/v1/completions",
        body=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        retries=False,
        timeout=urllib3.Timeout(total=60),
    )
    if response.status != 200:
        return None
    record: dict[str, Any] = orjson.loads(response.data)["kvledger"]
    return record


def _traffic(proxy: Proxy, key: str, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    i = 0
    while not stop.is_set():
        record = _complete(proxy, key, f"production {proxy.url} {i} " + "tell me more " * (i % 5))
        if record is not None:
            out.append(record)
        i += 1


class Broken(Exception):
    """The run answered 503 saying it is broken (the message)."""


def _play(
    sdk: openai.OpenAI, episodes: list[Episode], *, until_broken: bool = False
) -> list[dict[str, Any]]:
    """The episodes' requests in order; a request refused 503 while Redis fails over (the run's
    arm or lease unreadable: refused before the replica ran it) is sent again, boundedly. With
    ``until_broken``, a 503 saying the run is broken raises :class:`Broken`."""
    records = []
    for episode in episodes:
        outputs: list[str] = []
        for _ in range(episode.turns):
            deadline = time.monotonic() + 60
            while True:
                try:
                    text, _headers, record = complete(sdk, episode.render(outputs), episode.id)
                    break
                except openai.InternalServerError as exc:
                    message = str(exc.response.json()["error"]["message"])
                    broken = re.search(r"\brun \S+ broken\b", message)
                    if until_broken and exc.status_code == 503 and broken:
                        raise Broken(message) from exc
                    if exc.status_code != 503 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            outputs.append(text)
            records.append(record)
    return records


def _metric(proxy: Proxy, name: str) -> float:
    text = HTTP.request("GET", proxy.url + "/metrics", retries=False).data.decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    raise AssertionError(f"no metric {name}")


def _until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _stream_ids(cluster: LocalCluster, replicas: list[str]) -> list[str]:
    """Every request id in every replica's lineage stream, repeats included."""
    nodes = [SyncNode("127.0.0.1", n.port) for n in cluster.nodes if n.running]
    found: list[str] = []
    with RedisCluster(startup_nodes=nodes) as rc:
        for replica in replicas:
            for _id, fields in rc.xrange(f"kvl:{{replica:{replica}}}:lineage"):
                found.append(fields[b"id"].decode())
    return found


def _play_or_break(sdk: openai.OpenAI, episodes: list[Episode]) -> str:
    """Like ``_play``, but a 503 that says the run is broken ends it: that message (or "")."""
    try:
        _play(sdk, episodes, until_broken=True)
    except Broken as exc:
        return str(exc)
    return ""


def _same_shard(cluster: LocalCluster, port: int) -> str:
    """A replica id whose keys' slot the master on ``port`` owns."""
    for name in (f"s{i}" for i in range(200)):
        if cluster.master_of(f"kvl:{{replica:{name}}}:cache").port == port:
            return name
    raise AssertionError("no replica id maps to that master")


@pytest.fixture
def cluster_replicas(
    cluster: LocalCluster, replicas: dict[str, Replica]
) -> Iterator[dict[str, Replica]]:
    """The session's replicas and one more, whose keys live on the master that owns r1's."""
    name = _same_shard(cluster, cluster.master_of("kvl:{replica:r1}:cache").port)
    with launch([ReplicaSpec(name)]) as (extra,):
        yield {**replicas, name: extra}


def test_a_master_killed_under_traffic_loses_no_answered_record(
    cluster: LocalCluster, cluster_replicas: dict[str, Replica]
) -> None:
    replicas = cluster_replicas
    proxies = [_proxy(replicas, cluster.url), _proxy(replicas, cluster.url)]
    for proxy in proxies:
        proxy.start()
    try:
        prod_key = proxies[0].create_key("prod")
        made = cli(proxies[0], "keys", "create", "arm-off", "--mode", "eval", "--cache", "off")
        assert made.returncode == 0, made.stderr
        sdk = client(proxies[1], made.stdout.strip())
        # r1's shard fails; the eval arm (cache off) is served by r3, on another shard; the
        # arm 'arm-shard' (cache reset) is pinned to a replica whose keys are on r1's shard.
        victim = cluster.master_of("kvl:{replica:r1}:cache")
        assert cluster.master_of("kvl:{replica:r3}:cache").port != victim.port
        (shard,) = set(replicas) - {"r1", "r2", "r3"}
        pinned = ("--mode", "eval", "--cache", "reset", "--replica", shard)
        made = cli(proxies[0], "keys", "create", "arm-shard", *pinned)
        assert made.returncode == 0, made.stderr
        shard_sdk = client(proxies[0], made.stdout.strip())
        shard_run = begin(proxies[0], "arm-shard")
        assert _play_or_break(shard_sdk, EPISODES[:1]) == ""

        answered: list[dict[str, Any]] = []
        stop = threading.Event()
        threads = [
            threading.Thread(target=_traffic, args=(p, prod_key, stop, answered)) for p in proxies
        ]
        for thread in threads:
            thread.start()
        try:
            run = begin(proxies[1], "arm-off")
            _play(sdk, EPISODES[:3])
            _until(lambda: len(answered) >= 20, 120, "production traffic before the kill")
            victim.kill()
            _play(sdk, EPISODES[3:6])  # the eval run goes on during the failover
            broke = _play_or_break(shard_sdk, EPISODES[1:3])  # the failed shard's run
            cluster.wait_ok(60)  # the replica promoted, the cluster whole again
            assert cluster.master_of("kvl:{replica:r1}:cache").port != victim.port
            count = len(answered)
            _until(lambda: len(answered) >= count + 20, 120, "production traffic after it")
            _play(sdk, EPISODES[6:])
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
        for proxy in proxies:
            _until(
                lambda p=proxy: (
                    _metric(p, "kvl_ledger_spooled") == 0
                    and _metric(p, "kvl_ledger_buffer_depth") == 0
                    and _metric(p, "kvl_ledger_redis_up") == 1
                ),
                120,
                f"the spool of {proxy.url} drained",
            )
        ended = end(proxies[1], run["id"])

        # Every answered production request's record is in its stream exactly once (a record
        # answered durable: false may be gone with the master that took it, and only such).
        ids = _stream_ids(cluster, ["r1", "r2", "r3"])
        production = [r for r in answered if r.get("run") is None]
        assert any(r["pending"] for r in production), "no request met the failover"
        missing = [r for r in production if ids.count(r["request_id"]) == 0]
        assert all(r.get("durable") is False for r in missing), missing
        assert all(ids.count(r["request_id"]) <= 1 for r in production)
        audit = cli(proxies[0], "audit", "chain", "--json")
        *findings, ledger = [orjson.loads(line) for line in audit.stdout.splitlines()]
        assert ledger["ledger"]["complete"] is True, ledger  # no master lost its data
        not_durable = {r["request_id"] for r in production if r.get("durable") is False}
        if audit.returncode != 0:  # every gap must be a record answered durable: false
            assert not_durable, audit.stdout
        # The eval run: every record durable, one unbroken chain, the run not broken.
        records = LedgerView(cluster.url).tail(run=run["id"])
        assert len(records) == sum(e.turns for e in EPISODES)
        assert all(r["durable"] is True for r in records), records
        assert chained(records) and all(r["verified"] for r in records)
        assert ended["status"] == "ended", ended
        assert findings and {f["replica"] for f in findings} >= {"r1", "r3"}
        # The failed shard's run: one chain, no seq twice (never a silent fork); it went on,
        # every record durable and verified, or it broke saying why (a step that had to wait
        # for Redis), and the record answered before the break says whether it was durable.
        meta = admin(proxies[0], "GET", f"/admin/runs/{shard_run['id']}")[1]["run"]
        kept = LedgerView(cluster.url).tail(run=shard_run["id"])
        assert chained(kept) and len({r["seq"] for r in kept}) == len(kept), kept
        if broke:
            assert meta["status"] == "broken" and meta["end_reason"] in broke, (meta, broke)
            assert "Redis" in meta["end_reason"]
            assert all(isinstance(r.get("durable"), bool) for r in kept if not r["pending"])
        else:
            assert meta["status"] == "live", meta
            assert len(kept) == sum(e.turns for e in EPISODES[:3])
            assert all(r["verified"] and r["durable"] is True for r in kept), kept
    finally:
        for proxy in proxies:
            proxy.stop()


def test_up_with_a_redis_cluster_serves_and_the_commands_read_it(tmp_path: Path) -> None:
    """``kvledger up --redis-cluster 3``: 6 redis-servers (3 masters, 1 replica each), the
    proxy on the cluster; the printed request works, the printed settings let ``kvledger audit
    chain`` and ``lineage tail`` read the cluster; Ctrl-C stops every process it started."""
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVL_REDIS_URL")}
    command = [sys.executable, "-m", "router.cli", "up", "--port", str(port)]
    command += ["--workdir", str(tmp_path), "--redis-cluster", "3"]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert up.stdout is not None
    output = b""
    deadline = time.monotonic() + 180
    while b"Ctrl-C stops everything" not in output and time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        output += line
    text = output.decode()
    try:
        assert "redis+cluster://" in text, text
        key = re.search(r"API key \(shown once\): (\S+)", text)
        assert key is not None, text
        status, _, body = chat(port, key.group(1), "Hello!")
        assert status == 200 and not body["kvledger"]["pending"], body
        exported = re.search(r"export (KVL_URL=\S+ KVL_REDIS_URL=\S+ KVL_ADMIN_TOKEN=\S+)", text)
        assert exported is not None, text
        cli_env = {**env, **dict(v.split("=", 1) for v in exported.group(1).split())}
        for args in (["audit", "chain"], ["lineage", "tail", "--json"]):
            done = subprocess.run(
                [sys.executable, "-m", "router.cli", *args],
                capture_output=True,
                text=True,
                env=cli_env,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr + done.stdout
            assert body["kvledger"]["request_id"] in done.stdout or "every chain holds" in (
                done.stdout
            )
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    assert up.returncode == 0, rest.decode()
    pids = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert pids.strip() == "", f"processes left behind: {pids}"


@needs_compose
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_compose_cluster_override_puts_the_proxy_on_six_cluster_nodes(
    project: Path, profile: str
) -> None:
    """compose/docker-compose.cluster.yml validates on top of docker-compose.yml: six cluster
    nodes, one that creates the cluster, and the profile's proxy on a redis+cluster:// URL that
    names nodes of this file, started only after the cluster was created."""
    services = active_services(project, profile, BASE, "docker-compose.cluster.yml")
    nodes = {name for name in services if name.startswith("redis-") and name[6:].isdigit()}
    assert len(nodes) == 6
    for name in nodes:
        command = services[name]["command"]
        assert "--cluster-enabled" in command and name in command  # announces its own name
    proxy = services[f"kvledger-{profile}"]
    url = proxy["environment"]["KVL_REDIS_URL"]
    hosts = {node.split(":")[0] for node in url.removeprefix("redis+cluster://").split(",")}
    assert url.startswith("redis+cluster://") and hosts <= nodes
    assert proxy["depends_on"]["redis-cluster-init"]["condition"] == (
        "service_completed_successfully"
    )
    init = " ".join(services["redis-cluster-init"]["command"])
    assert "--cluster-replicas 1" in init and all(f"{n}:6379" in init for n in nodes)


@pytest.mark.parametrize("breaks", [False, True])
def test_an_eval_record_no_replica_acknowledged_says_so_and_may_break_its_run(
    replicas: dict[str, Replica], breaks: bool
) -> None:
    """One Redis with a replica: eval records are answered ``durable: true``. The replica
    killed, the next record waits ``durable_wait_ms`` and is answered ``durable: false``; the run
    names it (``not_durable``), and with ``break_on_not_durable`` the run is broken (the next
    request refused 503 with the reason)."""
    server = RedisServer()
    server.start()
    follower = RedisReplica(server.port)
    follower.start()
    extra = f"\n[eval]\ndurable_wait_ms = 500\nbreak_on_not_durable = {str(breaks).lower()}\n"
    proxy = Proxy(list(replicas.values()), server.url, extra=extra)
    try:
        proxy.start()
        made = cli(proxy, "keys", "create", "arm-d", "--mode", "eval", "--cache", "off")
        assert made.returncode == 0, made.stderr
        sdk = client(proxy, made.stdout.strip())
        run = begin(proxy, "arm-d")
        _, _, first = complete(sdk, "first eval request")
        assert first["durable"] is True
        follower.close()
        _, _, second = complete(sdk, "second eval request")
        assert second["durable"] is False and not second["pending"]
        assert "not acknowledged by a Redis replica" in second["warning"]
        shown = LedgerView(server.url).tail(run=run["id"])
        assert [r["durable"] for r in shown] == [True, False]
        status, meta = admin(proxy, "GET", f"/admin/runs/{run['id']}")
        assert status == 200, meta
        if breaks:
            assert meta["run"]["status"] == "broken", meta
            with pytest.raises(openai.InternalServerError, match="not acknowledged"):
                complete(sdk, "third eval request")
        else:
            assert meta["run"]["status"] != "broken", meta
            assert meta["run"]["not_durable"] == second["request_id"], meta
    finally:
        proxy.stop()
        follower.close()
        server.close()
