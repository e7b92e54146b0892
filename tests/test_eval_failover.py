"""Failover of eval runs (issue 24): a run whose replica dies or is drained moves by verified reset
and replay and goes on exact; a run that cannot move breaks with the reason; an arm whose
replica is down keeps one failed run (issue 27, item 4)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from backends.sim.engine_files import PERTURB_FILE
from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import ModelSettings
from bench.workload import Episode, make_episodes
from policies import rendezvous_order
from tests.eval_helpers import HTTP, admin, chained, cli, client, complete
from tests.proxy_harness import Proxy
from tests.servers import RedisServer
from tests.test_fault_suite import GENERATE, frozen_mid_stream

EPISODES = make_episodes(80)[:3]
REUSE = ("m1", "m2", "m3")


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Replica]]:
    """Three reuse replicas, two without reuse, and one reuse replica of another engine."""
    specs = [ReplicaSpec(r) for r in REUSE]
    specs += [ReplicaSpec(r, ModelSettings(reuse=False)) for r in ("o1", "o2")]
    specs.append(ReplicaSpec("x1", ModelSettings(weight_seed=1)))
    with launch(specs) as running:
        yield {r.id: r for r in running}


@pytest.fixture(scope="module")
def proxy(fleet: dict[str, Replica]) -> Iterator[Proxy]:
    redis = RedisServer()
    redis.start()
    proxy = Proxy([fleet[r] for r in (*REUSE, "o1", "o2")], redis.url)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
        redis.close()


def play(
    sdk: openai.OpenAI, episodes: list[Episode], at: int = -1, event: Callable[[], None] = print
) -> list[dict[str, Any]]:
    """Every episode turn by turn; ``event`` runs before request number ``at`` (0-based)."""
    records: list[dict[str, Any]] = []
    for episode in episodes:
        outputs: list[str] = []
        for _ in range(episode.turns):
            if len(records) == at:
                event()
            text, _, record = complete(sdk, episode.render(outputs), episode.id)
            outputs.append(text)
            records.append(record)
    return records


def run_of(proxy: Proxy, run: str) -> dict[str, Any]:
    status, body = admin(proxy, "GET", f"/admin/runs/{run}")
    assert status == 200, body
    meta: dict[str, Any] = body["run"]
    return meta


def move_runs(proxy: Proxy, replica: str) -> str:
    result = cli(proxy, "replicas", "drain", replica, "--move-runs")
    return result.stdout + result.stderr


def undrain(proxy: Proxy, replica: str) -> None:
    assert admin(proxy, "POST", f"/admin/replicas/{replica}/undrain")[0] == 200


def rerun_diverged(proxy: Proxy, sdk: openai.OpenAI, arm: str, run: str) -> int:
    """A clean rerun of the arm; ``kvledger runs diff`` of ``run`` against it: diverged."""
    admin(proxy, "POST", f"/admin/runs/{run}/end")
    clean = play(sdk, EPISODES)
    assert {r["run"] for r in clean} != {run}
    result = cli(proxy, "runs", "diff", run, clean[0]["run"], "--json")
    assert result.returncode == 0, result.stderr
    summary = orjson.loads(result.stdout)["summary"]
    admin(proxy, "POST", f"/admin/runs/{clean[0]['run']}/end")
    assert summary["episodes"] == len(EPISODES)
    return int(summary["diverged"])


def assert_moved_once_and_exact(proxy: Proxy, records: list[dict[str, Any]]) -> dict[str, Any]:
    runs = {r["run"] for r in records}
    assert len(runs) == 1, runs
    meta = run_of(proxy, runs.pop())
    assert meta["status"] == "live" and len(meta["moves"]) == 1, meta
    move = meta["moves"][0]
    assert move["to"] == meta["replica"] != move["from"]
    assert all(r["exact"] and r["verified"] and r["status"] == "ok" for r in records)
    assert {r["replica"] for r in records} == {move["from"], move["to"]}
    assert chained([r for r in records if r["replica"] == move["to"]])
    assert [r.get("move") for r in records] == [
        1 if r["replica"] == move["to"] else None for r in records
    ]
    return meta


def test_a_drained_replica_moves_its_reset_run_which_goes_on_exact(proxy: Proxy) -> None:
    """`replicas drain ID --move-runs` mid-episode: the run moves (reset, replay), goes on
    exact on the new replica, lists one move, and a clean rerun does not diverge from it."""
    sdk = client(proxy, proxy.create_key("fo-drain", mode="eval", cache="reset"))
    leased: list[str] = []

    def drain() -> None:
        replica = run_of(proxy, records[0]["run"])["replica"]
        leased.append(replica)
        out = move_runs(proxy, replica)
        assert f"moved {replica} ->" in out, out

    records: list[dict[str, Any]] = []
    records.extend(play(sdk, EPISODES[:1]))
    records.extend(play(sdk, EPISODES[1:], at=3, event=drain))
    meta = assert_moved_once_and_exact(proxy, records)
    assert meta["moves"][0]["replayed"] == EPISODES[0].turns + 3
    shown = cli(proxy, "runs", "show", meta["id"]).stdout
    assert "move 1" in shown and f"{leased[0]} -> {meta['replica']}" in shown
    assert 'kvl_run_moves_total{outcome="moved"}' in proxy_metrics(proxy)
    bearer = {"Authorization": "Bearer admin-secret"}
    page = HTTP.request("GET", f"{proxy.url}/ui/runs/{meta['id']}", headers=bearer).data.decode()
    assert "<h2>Moves</h2>" in page and f"<td>{leased[0]}</td><td>{meta['replica']}</td>" in page
    listed = HTTP.request("GET", f"{proxy.url}/ui/runs", headers=bearer).data.decode()
    assert "(moved 1&times;)" in listed
    undrain(proxy, leased[0])
    assert rerun_diverged(proxy, sdk, "fo-drain", meta["id"]) == 0


def test_a_run_on_a_replica_removed_from_the_config_moves_to_a_proxy_without_it(
    proxy: Proxy, fleet: dict[str, Replica]
) -> None:
    """A proxy configured without the run's replica (removed from its config) answers the
    run's requests 503 naming the replica and the command; ``drain ID --move-runs`` there
    moves the run onto that proxy's replicas, and the run goes on exact."""
    key = proxy.create_key("fo-removed", mode="eval", cache="reset")
    records = play(client(proxy, key), EPISODES[:1])
    leased = run_of(proxy, records[0]["run"])["replica"]
    others = [fleet[r] for r in (*REUSE, "o1", "o2") if r != leased]
    second = Proxy(others, proxy.redis_url)
    second.start()
    try:
        moved_sdk = client(second, key)
        with pytest.raises(openai.APIStatusError) as refused:
            complete(moved_sdk, "sent to the proxy without the replica")
        message = refused.value.response.json()["error"]["message"]
        assert refused.value.response.status_code == 503 and leased in message
        assert f"kvledger replicas drain {leased} --move-runs" in message
        out = move_runs(second, leased)
        assert f"moved {leased} ->" in out and "not configured here" in out, out
        records += play(moved_sdk, EPISODES[1:])
        meta = assert_moved_once_and_exact(second, records)
        assert "not in this proxy's configuration" in meta["moves"][0]["why"]
        missing = cli(second, "replicas", "drain", "nowhere", "--move-runs")
        assert missing.returncode != 0 and "no replica 'nowhere'" in missing.stdout + missing.stderr
        admin(second, "POST", f"/admin/runs/{meta['id']}/end")
    finally:
        second.stop()


def proxy_metrics(proxy: Proxy) -> str:
    return HTTP.request("GET", proxy.url + "/metrics").data.decode()


def assert_broken(proxy: Proxy, sdk: openai.OpenAI, run: str, why: str, prompt: str) -> None:
    """The run is broken saying ``why``, and the arm's next request gets a 503 saying it."""
    meta = run_of(proxy, run)
    assert meta["status"] == "broken" and why in meta["end_reason"], meta
    with pytest.raises(openai.APIStatusError) as refused:
        complete(sdk, prompt)
    assert refused.value.response.status_code == 503
    assert why in refused.value.response.json()["error"]["message"]


def test_a_replay_arm_and_an_off_arm_move_and_a_shared_arm_breaks(proxy: Proxy) -> None:
    """A `replay:` arm moves (the snapshot and the run replayed) and an `off` arm moves with
    nothing to replay; a `shared` arm cannot move and breaks, naming why."""
    snap = {"name": "fo-snap", "requests": [{"prompt": "the shared preamble " * 8}]}
    assert admin(proxy, "POST", "/admin/snapshots", snap)[0] == 201
    for arm, cache, replayed in (("fo-replay", "replay:fo-snap", 3), ("fo-off", "off", 0)):
        sdk = client(proxy, proxy.create_key(arm, mode="eval", cache=cache))
        records = [complete(sdk, f"{arm} request {i}")[2] for i in range(2)]
        leased = run_of(proxy, records[0]["run"])["replica"]
        assert f"moved {leased} ->" in move_runs(proxy, leased)
        records += [complete(sdk, f"{arm} request {i}")[2] for i in range(2, 4)]
        meta = assert_moved_once_and_exact(proxy, records)
        assert meta["moves"][0]["replayed"] == replayed
        undrain(proxy, leased)
        admin(proxy, "POST", f"/admin/runs/{meta['id']}/end")
    sdk = client(proxy, proxy.create_key("fo-shared", mode="eval", cache="shared"))
    run = complete(sdk, "a shared request")[2]["run"]
    leased = run_of(proxy, run)["replica"]
    assert "not moved" in move_runs(proxy, leased)
    undrain(proxy, leased)
    assert_broken(proxy, sdk, run, "not reproducible", "after the break")


def test_a_replica_that_cannot_reproduce_the_history_breaks_the_run(
    proxy: Proxy, fleet: dict[str, Replica]
) -> None:
    """The other replicas compute other numbers under the same engine digest (the stand-in's
    test-only switch): the replayed outputs differ, the run breaks with that reason, and no
    request of the arm is served from the state the replay reached."""
    sdk = client(proxy, proxy.create_key("fo-perturbed", mode="eval", cache="reset"))
    records = [complete(sdk, f"perturbed {i}: tell me about the weather")[2] for i in range(3)]
    run, leased = records[0]["run"], records[0]["replica"]
    switches = [model_dir(fleet[r]) / PERTURB_FILE for r in REUSE if r != leased]
    for switch in switches:
        switch.write_text("test\n")
    try:
        out = move_runs(proxy, leased)
    finally:
        for switch in switches:
            switch.unlink()
    assert "not moved" in out and "another output" in out, out
    assert_broken(proxy, sdk, run, "did not reproduce", "perturbed 3")
    served = [r for r in cli_records(proxy, run) if r.get("policy") != "replay"]
    assert [r["request_id"] for r in served] == [r["request_id"] for r in records]
    undrain(proxy, leased)
    for replica in REUSE:  # load the unperturbed weights again
        if replica != leased:
            assert admin(proxy, "POST", f"/admin/replicas/{replica}/reset")[0] == 200


def model_dir(replica: Replica) -> Path:
    return replica.workdir / "models" / "tensorrt_llm"


def cli_records(proxy: Proxy, run: str) -> list[dict[str, Any]]:
    result = cli(proxy, "lineage", "tail", "--run", run, "--count", "100", "--json")
    assert result.returncode == 0, result.stderr
    return [orjson.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_other_engine_digests_break_the_run_with_that_reason(
    fleet: dict[str, Replica], redis_server: RedisServer
) -> None:
    """The only other replica has another engine digest: the run cannot move, says why."""
    proxy = Proxy([fleet["m1"], fleet["x1"]], redis_server.url)
    proxy.start()
    try:
        arm = next(a for a in (f"fo-digest-{i}" for i in range(50)) if top(a) == "m1")
        sdk = client(proxy, proxy.create_key(arm, mode="eval", cache="reset", replica=None))
        run = complete(sdk, "digest request")[2]["run"]
        out = move_runs(proxy, "m1")
        assert "not moved" in out and "engine digest" in out and "differs" in out, out
        assert run_of(proxy, run)["status"] == "broken"
        assert 'kvl_run_moves_total{outcome="broken"} 1.0' in proxy_metrics(proxy)
    finally:
        proxy.stop()


def top(arm: str) -> str:
    return rendezvous_order(arm, ["m1", "x1"])[0]


def test_a_killed_replica_moves_its_run_mid_episode_and_it_goes_on_exact(
    proxy: Proxy, fleet: dict[str, Replica]
) -> None:
    """kill -9 of the leased replica's tritonserver mid-episode: the run finishes on another
    replica, with one move, every record exact, no 5xx, and no divergence from a clean rerun."""
    sdk = client(proxy, proxy.create_key("fo-kill", mode="eval", cache="reset"))
    killed: list[str] = []

    def kill() -> None:
        replica = run_of(proxy, records[0]["run"])["replica"]
        killed.append(replica)
        process = fleet[replica].process
        assert process is not None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    records: list[dict[str, Any]] = []
    records.extend(play(sdk, EPISODES[:1]))
    records.extend(play(sdk, EPISODES[1:], at=4, event=kill))
    meta = assert_moved_once_and_exact(proxy, records)
    assert meta["moves"][0]["from"] == killed[0]
    assert rerun_diverged(proxy, sdk, "fo-kill", meta["id"]) == 0


def test_a_stream_cut_by_its_replica_death_names_the_failover_and_the_run_moves(
    fleet: dict[str, Replica], redis_server: RedisServer
) -> None:
    """The leased replica dies while a stream of the run is sending tokens: the stream ends with
    an error event naming the failover, and the run's next request is served on another replica
    from the moved state (its record continues the run's chain, exactly)."""
    alive = [fleet[r] for r in REUSE if fleet[r].process and fleet[r].process.poll() is None]
    extra = "[eval]\nmin_production_replicas = 0"
    proxy = Proxy(alive, redis_server.url, extra=extra)
    proxy.start()
    try:
        key = proxy.create_key("fo-stream", mode="eval", cache="reset")
        sdk = client(proxy, key)
        first = complete(sdk, "before the stream")[2]
        leased = fleet[first["replica"]]
        stream = frozen_mid_stream(proxy, key, leased, *GENERATE)
        assert leased.process is not None
        os.killpg(leased.process.pid, signal.SIGKILL)
        leased.process.wait()
        error = orjson.loads(stream.read_to_end()[-1])["error"]
        assert "failover" in error["message"] and leased.id in error["message"], error
        after = complete(sdk, "after the stream")[2]
        meta = run_of(proxy, first["run"])
        assert after["run"] == first["run"] and len(meta["moves"]) == 1
        assert after["replica"] == meta["replica"] != leased.id
        assert after["exact"] and after["verified"] and after["status"] == "ok"
    finally:
        proxy.stop()


def test_a_request_stuck_past_backend_timeout_s_moves_the_run_and_is_retried(
    fleet: dict[str, Replica], redis_server: RedisServer
) -> None:
    """The run's replica stops making progress (SIGSTOP) under a request: past
    backend_timeout_s the request is recorded there once (failed), the run moves, and the
    client gets the retry's answer instead of a 504."""
    extra = "[eval]\nmin_production_replicas = 0\n[limits]\nbackend_timeout_s = 2"
    proxy = Proxy([fleet["o1"], fleet["o2"]], redis_server.url, extra=extra)
    proxy.start()
    try:
        sdk = client(proxy, proxy.create_key("fo-stuck", mode="eval", cache="off"))
        run = complete(sdk, "before")[2]["run"]
        stuck = fleet[run_of(proxy, run)["replica"]]
        with ThreadPoolExecutor(1) as pool:
            answer = frozen_under_a_request(proxy, sdk, stuck, pool)
            try:
                text, record = answer.result()
            finally:
                assert stuck.process is not None
                os.killpg(stuck.process.pid, signal.SIGCONT)
        meta = run_of(proxy, run)
        assert len(meta["moves"]) == 1 and record["replica"] == meta["replica"] != stuck.id
        assert "backend_timeout_s" in meta["moves"][0]["why"]
        assert record["status"] == "ok" and text
    finally:
        proxy.stop()


def frozen_under_a_request(
    proxy: Proxy, sdk: openai.OpenAI, replica: Replica, pool: ThreadPoolExecutor
) -> Future[tuple[str, dict[str, Any]]]:
    """A long request of the run in flight on ``replica``, with the replica stopped (SIGSTOP,
    its server and its model's stub) before the request could end by itself."""
    assert replica.process is not None
    for attempt in range(5):
        answer = pool.submit(long_completion, sdk, attempt)
        wait_for(lambda a=answer: in_flight(proxy, replica.id) == 1 or a.done())
        os.killpg(replica.process.pid, signal.SIGSTOP)
        if in_flight(proxy, replica.id) == 1:
            return answer
        os.killpg(replica.process.pid, signal.SIGCONT)  # it ended by itself: again
        answer.result()
    raise AssertionError(f"every long request on {replica.id} ended by itself")


def test_a_request_in_flight_when_its_replica_dies_is_retried_after_the_move(
    fleet: dict[str, Replica], redis_server: RedisServer
) -> None:
    """A non-streamed request is running when its run's replica is killed: it is recorded once
    there (failed, with the failover), the run moves, and the client gets the retry's answer
    from the new replica, not an error."""
    extra = "[eval]\nmin_production_replicas = 0"  # no production pool here
    proxy = Proxy([fleet["o1"], fleet["o2"]], redis_server.url, extra=extra)
    proxy.start()
    try:
        sdk = client(proxy, proxy.create_key("fo-inflight", mode="eval", cache="off"))
        run = complete(sdk, "before")[2]["run"]
        leased = fleet[run_of(proxy, run)["replica"]]
        assert leased.process is not None
        with ThreadPoolExecutor(1) as pool:
            answer = frozen_under_a_request(proxy, sdk, leased, pool)
            os.killpg(leased.process.pid, signal.SIGKILL)
            leased.process.wait()
            text, record = answer.result()
        meta = run_of(proxy, run)
        assert len(meta["moves"]) == 1 and record["replica"] == meta["replica"] != leased.id
        assert record["status"] == "ok" and record["exact"] and text
        failed = [r for r in cli_records(proxy, run) if r["request_id"] == record["request_id"]]
        assert sorted((r["replica"], r["status"]) for r in failed) == sorted(
            [(leased.id, "error"), (meta["replica"], "ok")]
        )
    finally:
        proxy.stop()


def long_completion(sdk: openai.OpenAI, attempt: int) -> tuple[str, dict[str, Any]]:
    raw = sdk.completions.with_raw_response.create(
        model="ensemble", prompt=f"a long story, take {attempt}", max_tokens=3000
    )
    body = raw.parse()
    return body.choices[0].text, body.model_extra["kvledger"]  # type: ignore[index]


def in_flight(proxy: Proxy, replica: str) -> int:
    replicas = admin(proxy, "GET", "/admin/replicas")[1]["replicas"]
    return int(next(r["in_flight"] for r in replicas if r["id"] == replica))


def wait_for(condition: Callable[..., bool]) -> None:
    deadline = time.monotonic() + 60  # a safety net against a hang, not a measure
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_arm_whose_replica_is_down_keeps_one_failed_run(
    proxy: Proxy, fleet: dict[str, Replica]
) -> None:
    """Issue 27 item 4: an arm pinned to a dead replica gets 503 with the reason and a
    Retry-After on every request, all naming one failed run, not a new run per request."""
    dead = next(r for r in REUSE if fleet[r].process and fleet[r].process.poll() is not None)
    sdk = client(proxy, proxy.create_key("fo-down", mode="eval", cache="reset", replica=dead))
    runs = set()
    for i in range(3):
        with pytest.raises(openai.APIStatusError) as refused:
            complete(sdk, f"down {i}")
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert dead in response.json()["error"]["message"]
        runs.add(response.headers.get("X-Kvl-Run") or "")
    listed = admin(proxy, "GET", "/admin/runs?arm=fo-down")[1]["runs"]
    assert len(listed) == 1 and listed[0]["status"] == "failed", listed
    assert runs <= {"", listed[0]["id"]}
