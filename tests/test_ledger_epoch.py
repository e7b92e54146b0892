"""The ledger notices when Redis lost its history (issue 27, item 2): the ledger epoch."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis
import urllib3

from backends.sim.launcher import Replica, free_ports
from router.ledger.audit import history, history_json
from router.ledger.epoch import LOST_REASON, EpochInfo
from router.ledger.persistence import kind
from tests.proxy_harness import Proxy
from tests.servers import RedisServer, redis_answers
from tests.test_ledger_truth import audit, complete, spooled, stream_records

HTTP = urllib3.PoolManager()


def _wait(condition: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _events(proxy: Proxy, name: str) -> list[dict[str, Any]]:
    events = []
    for line in proxy.log.splitlines():
        if f'"{name}"' in line:
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return [e for e in events if e.get("event") == name]


def _lost_metric(proxy: Proxy) -> float:
    page = HTTP.request("GET", proxy.url + "/metrics").data.decode()
    lines = [ln for ln in page.splitlines() if ln.startswith("kvl_ledger_epoch_lost_total ")]
    return float(lines[0].split()[1]) if lines else -1.0


def test_a_flush_under_a_running_proxy_is_an_error_a_metric_and_where_history_starts(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """FLUSHALL: the proxy logs ledger_epoch_lost (an error), counts it, starts unknown
    generations saying why, and ``audit chain`` says history starts after the loss."""
    proxy = Proxy([replicas["r1"]], redis_server.url)
    proxy.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        key = proxy.create_key("epoch")
        for _ in range(3):
            assert complete(proxy, key, "before " + uuid.uuid4().hex)[0] == 200
        before = audit(redis_server)
        assert before.returncode == 0 and "): complete" in before.stdout, before.stdout
        assert _lost_metric(proxy) == 0
        client.flushall()
        _wait(lambda: _events(proxy, "ledger_epoch_lost"), "the ledger_epoch_lost event")
        (event,) = _events(proxy, "ledger_epoch_lost")
        assert event["level"] == "error" and event["reason"] == LOST_REASON
        assert _lost_metric(proxy) == 1
        _wait(
            lambda: any(
                f[b"reason"].decode() == LOST_REASON for _, f in client.xrange("kvl:generations")
            ),
            "a generation started because Redis lost its data",
        )
        key = proxy.create_key("epoch-after")
        assert complete(proxy, key, "after " + uuid.uuid4().hex)[0] == 200
        after = audit(redis_server)
        assert after.returncode == 0, after.stdout + after.stderr
        assert f"{LOST_REASON} before it" in after.stdout, after.stdout
        assert f"records of epoch {event['lost_epoch']} are gone" in after.stdout
        lines = audit(redis_server, "--json").stdout.splitlines()
        ledger = orjson.loads(lines[-1])["ledger"]
        assert [orjson.loads(line)["replica"] for line in lines[:-1]] == ["r1"]
        assert ledger["complete"] is False and ledger["lost"] == [event["lost_epoch"]]
        assert ledger["current"] == ledger["epochs"][-1]["id"] != event["lost_epoch"]
        assert ledger["history_starts"] == ledger["epochs"][-1]["created_at"]
    finally:
        client.close()
        proxy.stop()


def test_spooled_records_drained_into_a_new_epoch_keep_order_and_say_why(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """Redis dies and comes back empty while records wait in the spool: they are written in
    the order they were answered, each with a chain position and the reason, not bare stale."""
    proxy = Proxy([replicas["r1"]], redis_server.url)
    proxy.start()
    try:
        key = proxy.create_key("spooled")
        assert complete(proxy, key, "warm " + uuid.uuid4().hex)[0] == 200
        redis_server.stop()
        shutil.rmtree(redis_server.dir)  # its data is gone: it restarts empty
        redis_server.dir.mkdir()
        answered = []
        for n in range(5):
            status, record = complete(proxy, key, f"while away {n} " + uuid.uuid4().hex)
            assert status == 200 and record is not None and record["pending"]
            answered.append(record["request_id"])
        redis_server.start()
        _wait(lambda: spooled(proxy) == 0, "the spool to drain")
        records = [r for r in stream_records(redis_server, "r1") if r["request_id"] in answered]
        assert [r["request_id"] for r in records] == answered
        for record in records:
            assert record["warning"].startswith(LOST_REASON), record
            assert record["stale"] is False and record["seq"] is not None, record
            assert record["state_known"] is False
        assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)
        _wait(lambda: _events(proxy, "ledger_epoch_lost"), "the ledger_epoch_lost event")
        clean = audit(redis_server)
        assert clean.returncode == 0 and f"{LOST_REASON} before it" in clean.stdout, clean.stdout
    finally:
        proxy.stop()


def test_history_lines_name_every_epoch_and_where_history_starts() -> None:
    first = EpochInfo("aaa", "2026-12-01T00:00:00.000+00:00")
    assert history([first])[-1] == (
        "history starts at 2026-12-01T00:00:00.000+00:00 (epoch aaa): complete"
    )
    second = EpochInfo("bbb", "2026-12-02T00:00:00.000+00:00", "aaa", "2026-12-01T23:59:59")
    lines = history([first, second])
    assert "after epoch aaa was lost" in lines[1]
    assert lines[-1].startswith("history starts at 2026-12-02T00:00:00.000+00:00 (epoch bbb)")
    assert "none" in history([])[0]
    assert history_json([first])["ledger"]["complete"] is True
    assert history_json([first, second])["ledger"]["lost"] == ["aaa"]
    assert history_json([])["ledger"]["history_starts"] is None


def _readyz(proxy: Proxy) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(HTTP.request("GET", proxy.url + "/readyz").data)
    return body


def test_a_redis_without_persistence_is_said_once_at_start_and_in_readyz(
    replicas: dict[str, Replica],
) -> None:
    """appendonly no and no save points: one warning in the log, ``none`` in /readyz; the
    tests' usual Redis (AOF) reads ``aof``, with no warning."""
    volatile, durable = RedisServer(appendonly=False), RedisServer()
    volatile.start()
    durable.start()
    proxies = [Proxy([replicas["r1"]], volatile.url), Proxy([replicas["r1"]], durable.url)]
    try:
        for proxy in proxies:
            proxy.start()
        warned, quiet = proxies
        assert _readyz(warned)["redis_persistence"] == "none"
        (event,) = _events(warned, "redis_without_persistence")
        assert event["level"] == "warning" and "appendonly" in event["warning"]
        assert _readyz(quiet)["redis_persistence"] == "aof"
        assert _events(quiet, "redis_without_persistence") == []
    finally:
        for proxy in proxies:
            proxy.stop()
        volatile.close()
        durable.close()


def test_a_redis_refusing_config_reads_unknown_and_the_proxy_serves(
    replicas: dict[str, Replica], tmp_path: Path
) -> None:
    """A managed Redis that refuses CONFIG: ``unknown`` in /readyz, no warning, no crash."""
    port = free_ports(1)[0]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--dir", str(tmp_path), "--rename-command", "CONFIG", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = Proxy([replicas["r1"]], f"redis://127.0.0.1:{port}/0")
    try:
        _wait(lambda: redis_answers(f"redis://127.0.0.1:{port}"), "the redis-server")
        proxy.start()
        assert _readyz(proxy)["redis_persistence"] == "unknown"
        assert _events(proxy, "redis_without_persistence") == []
        key = proxy.create_key("managed")
        assert complete(proxy, key, "hello " + uuid.uuid4().hex)[0] == 200
    finally:
        proxy.stop()
        server.terminate()
        server.wait(timeout=30)


def test_persistence_kinds() -> None:
    assert kind({b"appendonly": b"yes", b"save": b""}) == "aof"
    assert kind({"appendonly": "no", "save": "3600 1"}) == "rdb"
    assert kind({"appendonly": "yes", "save": "3600 1 300 100"}) == "aof+rdb"
    assert kind({"appendonly": "no", "save": ""}) == "none"
