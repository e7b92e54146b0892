"""Eval arms end to end: the workload through the proxy with the openai SDK, run twice per arm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.sim.launcher import Replica
from bench.workload import make_episodes
from router.ledger.chain import genesis
from tests.eval_helpers import admin, begin, chained, cli, client, complete, end, play
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import LocalCluster, RedisServer

EPISODES = make_episodes(80)[:12]


@pytest.fixture(scope="module")
def stack(
    replicas: dict[str, Replica], request: pytest.FixtureRequest
) -> Iterator[tuple[Proxy, LedgerView]]:
    """One proxy in front of r1, r2 (reuse on) and r3 (reuse off), with its own Redis, or
    (``cluster``, see ON_BOTH) on the session's Redis Cluster, flushed first."""
    if getattr(request, "param", "single") == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        url, redis = cluster.url, None
    else:
        redis = RedisServer()
        redis.start()
        url = redis.url
    proxy = Proxy(list(replicas.values()), url)
    proxy.start()
    try:
        yield proxy, LedgerView(url)
    finally:
        proxy.stop()
        if redis is not None:
            redis.close()


# The representative tests that run on one node and on a 3-master cluster.
ON_BOTH = pytest.mark.parametrize("stack", ["single", "cluster"], indirect=True)


def signatures(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["state_before"], r["state_after"], r["output_digest"]) for r in records]


def diff(proxy: Proxy, run_a: str, run_b: str) -> dict[str, Any]:
    result = cli(proxy, "runs", "diff", run_a, run_b, "--json")
    assert result.returncode == 0, result.stderr
    found: dict[str, Any] = orjson.loads(result.stdout)
    return found


@ON_BOTH
def test_reset_arm_reruns_identically(stack: tuple[Proxy, LedgerView]) -> None:
    """A reset arm run twice: same outputs, same state chain, no divergence, reuse inside a run."""
    proxy, ledger = stack
    sdk = client(proxy, proxy.create_key("arm-reset", mode="eval", cache="reset"))
    runs = []
    for _ in range(2):
        run = begin(proxy, "arm-reset")
        assert run["status"] == "live" and int(run["reset_ms"]) > 0
        played = play(sdk, EPISODES)
        assert played.runs == {run["id"]}
        runs.append((run, played))
        end(proxy, run["id"])
    (run_a, a), (run_b, b) = runs
    assert a.outputs == b.outputs
    assert run_a["replica"] == run_b["replica"]  # rendezvous: the rerun lands on the same one
    records_a, records_b = ledger.tail(run=run_a["id"]), ledger.tail(run=run_b["id"])
    assert len(records_a) == sum(e.turns for e in EPISODES)
    assert signatures(records_a) == signatures(records_b)
    assert records_a[0]["state_before"] == genesis(records_a[0]["engine_digest"])
    assert chained(records_a) and chained(records_b)
    assert all(r["verified"] and r["exact"] for r in records_a + records_b)
    assert records_a[0]["policy"] == "eval"
    assert records_a[0]["reason"].startswith("rendezvous rank 1 of 2 for arm 'arm-reset'")
    assert sum(r["reused_blocks"] for r in records_a) > 0  # caching stays on inside the run
    summary = diff(proxy, run_a["id"], run_b["id"])["summary"]
    assert summary["episodes"] == len(EPISODES) and summary["diverged"] == 0


@ON_BOTH
def test_shared_arm_diverges_and_explain_proves_the_cache(stack: tuple[Proxy, LedgerView]) -> None:
    """A shared arm reruns on the warm cache: episodes diverge, each classified by a rule that
    could fail; replay proves at least one divergence caused by cache state (each run's output
    reproduces under its own state) and says which one the cold computation matches."""
    proxy, ledger = stack
    reset = cli(proxy, "replicas", "reset", "r2")
    assert reset.returncode == 0, reset.stderr
    assert "generation" in reset.stdout
    sdk = client(proxy, proxy.create_key("arm-shared", mode="eval", cache="shared", replica="r2"))
    first = play(sdk, EPISODES)  # the first request begins the run
    (run_a,) = first.runs
    run_b = begin(proxy, "arm-shared")["id"]  # ends run_a, no reset
    second = play(sdk, EPISODES)
    end(proxy, run_b)
    assert second.runs == {run_b} and run_a != run_b
    records = ledger.tail(run=run_b)
    assert {r["replica"] for r in records} == {"r2"}
    assert records[0]["state_before"] == ledger.tail(run=run_a)[-1]["state_after"]
    found = diff(proxy, run_a, run_b)
    result = found["summary"]
    assert result["diverged"] > 0 and result["unknown"] == 0
    outputs = [e for e in found["episodes"] if e["kind"] == "output"]
    assert outputs and all(e["cause"] in ("reuse", "state", "unexplained") for e in outputs)
    assert result["reuse"] + result["state"] + result["unexplained"] == len(outputs)
    table = cli(proxy, "runs", "diff", run_a, run_b)
    assert f"{result['diverged']} diverged" in table.stdout
    explained = cli(proxy, "runs", "explain", run_a, run_b, "--limit", "2", "--json")
    assert explained.returncode == 0, explained.stderr
    assert "divergence(s) to explain" in explained.stderr  # progress, as it happens
    report = orjson.loads(explained.stdout)
    assert report["tried"] >= 1 and report["proven"] >= 1, report
    proven = [c for c in report["cases"] if c["proven"]]
    assert all(c["cold_matches"] in ("a", "b", "both", "neither") for c in proven)


def test_off_arm_reruns_identically_without_reuse(stack: tuple[Proxy, LedgerView]) -> None:
    """An off arm is served by the reuse-off replica: identical reruns, never a reused block."""
    proxy, ledger = stack
    created = cli(proxy, "keys", "create", "arm-off", "--mode", "eval", "--cache", "off")
    assert created.returncode == 0, created.stderr
    sdk = client(proxy, created.stdout.strip())
    outputs, runs = [], []
    for _ in range(2):
        run = begin(proxy, "arm-off")
        outputs.append(play(sdk, EPISODES[:6]).outputs)
        runs.append(run["id"])
        ended = cli(proxy, "runs", "end", run["id"])
        assert ended.returncode == 0 and "ended" in ended.stdout, ended.stderr
        shown = cli(proxy, "runs", "show", run["id"])
        assert "not_verified  0" in shown.stdout, shown.stdout
    assert outputs[0] == outputs[1]
    records = ledger.tail(run=runs[0]) + ledger.tail(run=runs[1])
    assert {r["replica"] for r in records} == {"r3"}
    assert all(r["reused_blocks"] == 0 and r["cached_tokens"] == 0 for r in records)
    assert all(r["verified"] for r in records)


def test_replay_arm_starts_every_run_at_the_snapshot(stack: tuple[Proxy, LedgerView]) -> None:
    """A replay arm: each run begins at the snapshot's fingerprint, and reruns are identical."""
    proxy, ledger = stack
    source = client(proxy, proxy.create_key("arm-source", mode="eval", cache="reset"))
    run = begin(proxy, "arm-source")["id"]
    play(source, EPISODES[:3])
    end(proxy, run)
    missing = cli(proxy, "keys", "create", "arm-x", "--mode", "eval", "--cache", "replay:nope")
    assert missing.returncode == 2 and "snapshot 'nope' does not exist" in missing.stderr
    saved = cli(proxy, "snapshots", "save", "warm", "--from-run", run, "--upto", "12")
    assert saved.returncode == 0, saved.stderr
    status, snapshot = admin(proxy, "GET", "/admin/snapshots/warm")
    assert status == 200 and snapshot["count"] == 12
    assert snapshot["fingerprint"] == ledger.tail(run=run)[11]["state_after"]
    created = cli(proxy, "keys", "create", "arm-replay", "--mode", "eval", "--cache", "replay:warm")
    sdk = client(proxy, created.stdout.strip())
    runs = []
    for _ in range(2):
        runs.append(begin(proxy, "arm-replay")["id"])
        play(sdk, EPISODES[3:7])
        end(proxy, runs[-1])
    first = [ledger.tail(run=r) for r in runs]
    replayed = [r for r in first[0] if r["policy"] == "replay"]
    served = [[r for r in records if r["policy"] == "eval"] for records in first]
    assert len(replayed) == 12
    assert served[0][0]["state_before"] == snapshot["fingerprint"]
    assert served[1][0]["state_before"] == snapshot["fingerprint"]
    assert signatures(served[0]) == signatures(served[1])
    assert diff(proxy, runs[0], runs[1])["summary"]["diverged"] == 0


def test_snapshot_from_a_file_is_replayed_to_its_fingerprint(
    stack: tuple[Proxy, LedgerView], tmp_path: Path
) -> None:
    """A requests file becomes a snapshot by a reset and a replay; a replay arm's run then
    begins at exactly the fingerprint that replay reached."""
    proxy, ledger = stack
    prompts = [EPISODES[8].render([]), EPISODES[9].render([]), "A: ls"]
    lines = [orjson.dumps({"prompt": p, "max_tokens": 8}).decode() for p in prompts]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_tokens": -1}\n')
    refused = cli(proxy, "snapshots", "save", "bad", "--from-file", str(bad))
    assert refused.returncode == 1 and "requests[1]" in refused.stderr
    saved = cli(
        proxy, "snapshots", "save", "filed", "--from-file", str(tmp_path / "requests.jsonl")
    )
    assert saved.returncode == 0, saved.stderr
    snapshot = admin(proxy, "GET", "/admin/snapshots/filed")[1]
    assert snapshot["count"] == 3 and snapshot["fingerprint"] in saved.stdout
    sdk = client(proxy, proxy.create_key("arm-filed", mode="eval", cache="replay:filed"))
    run = begin(proxy, "arm-filed")["id"]
    _, headers, record = complete(sdk, "A: cat README")
    end(proxy, run)
    assert record["state_before"] == snapshot["fingerprint"] == headers["x-kvl-state"]
    assert [r["policy"] for r in ledger.tail(run=run)] == ["replay"] * 3 + ["eval"]
