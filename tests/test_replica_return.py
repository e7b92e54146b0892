"""A replica back from a crash: once its tritonserver, restarted with its own command line,
reports ready, the proxy serves and leases it again within two monitor ticks; and the sequence
of issue 27's one unexplained 504 (restart, reset run, short request), repeated, answers 200."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from backends.sim.launcher import Replica, ReplicaSpec, is_ready, launch, server_environment
from router.cli.local import ProxyProcess, create_key
from tests.hostile_http import bearer, post_json, send
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

ADMIN = "admin-secret"
DOWN_TICKS = 50  # failed health checks while it is down (0.5 s apart): gRPC backoff grows past 10 s


@pytest.fixture
def crashed(redis_server: RedisServer) -> Iterator[tuple[Replica, ProxyProcess]]:
    """A replica of its own (others share the session's) and a proxy in front of it."""
    with launch([ReplicaSpec("back1")]) as (replica,):
        # One replica, which an eval run may lease (no production pool kept back).
        extra = "[eval]\nmin_production_replicas = 0"
        proxy = Proxy([replica], redis_server.url, monitor_interval_s=0.5, extra=extra)
        proxy.start()
        try:
            yield replica, proxy
        finally:
            proxy.stop()


def fleet_metrics(proxy: ProxyProcess, replica: str) -> tuple[float, float, float]:
    """The proxy's own view from one scrape: ready (1/0), generation, monitor ticks done."""
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=30) as response:
        page = response.read().decode()
    values: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = f'{{replica="{replica}"}}'
    return (
        values[f"kvl_replica_ready{label}"],
        values[f"kvl_replica_generation{label}"],
        values["kvl_monitor_ticks_total"],
    )


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float = 120) -> None:
    """A safety net against a hang, not a measure."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"not {what} within {deadline_s:g} s"
        time.sleep(0.1)


def restart(replica: Replica) -> None:
    """The replica's tritonserver again, on the same command line, ports and repository."""
    assert replica.process is not None
    command = [str(arg) for arg in replica.process.args]  # type: ignore[union-attr]
    with replica.log_path.open("ab") as log:
        replica.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_environment(),
            start_new_session=True,
        )


def begin_and_ask(proxy: ProxyProcess, key: str, arm: str, prompt: str) -> dict[str, object]:
    """Begin a reset run of ``arm`` (a verified reset of its leased replica), send it one short
    request, end the run; the request's lineage record."""
    begun = post_json(proxy.port, "/admin/runs", {"arm": arm}, bearer(ADMIN))
    assert begun.status == 201, begun.body
    run = begun.json()["run"]["id"]
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 4}
    answer = post_json(proxy.port, "/v1/completions", body, bearer(key))
    assert answer.status == 200, answer.body
    ended = post_json(proxy.port, f"/admin/runs/{run}/end", {}, bearer(ADMIN))
    assert ended.status == 200, ended.body
    record: dict[str, object] = answer.json()["kvledger"]
    assert record["run"] == run
    return record


def test_replica_restarted_after_a_crash_is_back_within_two_monitor_ticks(
    crashed: tuple[Replica, ProxyProcess],
) -> None:
    """kill -9 a replica, let the proxy's probes fail for a while, restart it: within two
    monitor ticks of the replica reporting ready, the proxy calls it healthy in a new
    generation and an eval run can lease it."""
    replica, proxy = crashed
    ready, generation, _ = fleet_metrics(proxy, replica.id)
    assert ready == 1
    assert replica.process is not None
    os.killpg(replica.process.pid, signal.SIGKILL)  # the server and its Python-backend stub
    replica.process.wait(timeout=30)
    wait_until(lambda: fleet_metrics(proxy, replica.id)[0] == 0, "marked unhealthy")
    down_since = fleet_metrics(proxy, replica.id)[2]
    # Long enough down that a client's reconnect backoff grows past several seconds.
    wait_until(lambda: fleet_metrics(proxy, replica.id)[2] >= down_since + DOWN_TICKS, "ticking")

    restart(replica)
    wait_until(lambda: is_ready(replica), "ready again (Triton's own health API)")
    ticks_at_ready = fleet_metrics(proxy, replica.id)[2]
    # A tick under way when the replica became ready may have probed it just before; the
    # next one starts after, and must find it.
    wait_until(lambda: fleet_metrics(proxy, replica.id)[2] >= ticks_at_ready + 2, "two ticks")
    ready, new_generation, _ = fleet_metrics(proxy, replica.id)
    assert ready == 1, proxy.log[-3000:]
    assert new_generation > generation

    key = create_key(proxy.redis_url, "returned", mode="eval", cache="reset")
    record = begin_and_ask(proxy, key, "returned", "back again")
    assert record["replica"] == replica.id
    assert send(proxy.port, "GET", "/readyz").status == 200


def test_restart_then_reset_run_then_short_request_repeatedly_answers_200(
    crashed: tuple[Replica, ProxyProcess],
) -> None:
    """Issue 27 item 5's sequence, three times: kill -9 the tritonserver alone (its stubs left
    running, as a hand restart leaves them), restart it with its own command line, wait until the
    proxy serves it, begin a reset run and send a 4-token request: 200 each time, never a 504,
    and each request is the first of a new, verified generation."""
    replica, proxy = crashed
    key = create_key(proxy.redis_url, "again", mode="eval", cache="reset")
    generations = []
    for attempt in range(3):
        old = replica.process
        assert old is not None
        os.kill(old.pid, signal.SIGKILL)
        old.wait(timeout=30)
        try:
            wait_until(lambda: fleet_metrics(proxy, replica.id)[0] == 0, "marked unhealthy")
            restart(replica)
            wait_until(lambda: is_ready(replica), "ready again")
            wait_until(lambda: fleet_metrics(proxy, replica.id)[0] == 1, "healthy in the proxy")
            record = begin_and_ask(proxy, key, "again", f"short request {attempt}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.pid, signal.SIGKILL)  # the old server's orphaned stubs
        assert record["seq"] == 0 and record["state_known"] is True, record
        generations.append(record["generation"])
    assert len(set(generations)) == 3
