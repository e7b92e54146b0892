"""The eval study through the proxy: how often reruns diverge, by cache control, at 16 and 4 bits.

For each weight precision it starts three stand-in replicas (p1 and p2 with block reuse, p3
without), a private Redis and one proxy (`min_production_replicas = 1`), and plays the
80-episode agent workload (bench/workload.py) several times back to back through the openai
SDK for each arm:

- `off`: an eval key with `cache="off"` (served by p3, runs begun and ended explicitly);
- `shared`: an eval key with `cache="shared"` pinned to p1: caching on, no control, every
  request recorded with its input (so a divergence can be replayed); p1 gets a verified reset
  before the first run, later runs meet the warm cache;
- `reset`: an eval key with `cache="reset"` (every run begins on a verified reset);
- `replay`: an eval key with `cache="replay:warm-<precision>"`, the snapshot saved from the
  first `reset` run's first `--snapshot-upto` requests.

Each later run is compared with the arm's first run (router/eval/diff.py): divergent episodes,
block reuse, wall time per run, each first divergence's cause by the falsifiable rule (reuse
differed, state differed with equal reuse, unexplained, unknown state), and, for a sample of
`--explain` divergences per rerun, a proof by replay (`POST /admin/runs/explain`): proven means
each run's output reproduces under its own cache state. (The verified reset's cost is measured
by bench/reset_timing.py.)
It writes `eval-study.md` and `eval-study.png` under `--out` and prints the Markdown.

    .venv/bin/python -m bench.eval_study [--episodes 80] [--runs 3] [--precisions bf16,int4]
        [--snapshot-upto 40] [--explain 3] [--out docs/results]

The default configuration takes about 37 minutes on 2 shared CPU cores, half of it in the
cache-off arm (every turn recomputes its whole prefix); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import orjson
import urllib3

from backends.sim.launcher import Replica, ReplicaSpec, config_snippet, launch
from backends.sim.repository import ModelSettings, Precision
from bench.eval_study_report import ArmResult, chart, markdown
from bench.workload import Episode, make_episodes
from router.cli.local import ProxyProcess, RedisServer, create_key
from router.eval.diff import diff_runs
from tests.eval_helpers import Played, admin, begin, client, end, play

HTTP = urllib3.PoolManager()

EVAL_SETTINGS = "\n[eval]\nmin_production_replicas = 1\n"
STARTED = time.perf_counter()


@dataclass
class Stack:
    """One precision's replicas, keyed by id, and the proxy in front of them."""

    precision: str
    proxy: ProxyProcess
    replicas: dict[str, Replica]


@dataclass
class Pass:
    """One run of the workload: what the client saw and how long it took."""

    played: Played
    seconds: float
    run: str | None = None  # the eval run's id; None for production passes


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


@contextmanager
def stack(precision: Precision) -> Iterator[Stack]:
    specs = [
        ReplicaSpec("p1", ModelSettings(precision=precision)),
        ReplicaSpec("p2", ModelSettings(precision=precision)),
        ReplicaSpec("p3", ModelSettings(precision=precision, reuse=False)),
    ]
    progress(f"{precision}: starting replicas p1, p2 (reuse on), p3 (reuse off), Redis, proxy")
    with launch(specs) as replicas:
        redis = RedisServer()
        redis.start()
        proxy = ProxyProcess(
            config_snippet(replicas), redis.url, extra=EVAL_SETTINGS, monitor_interval_s=0.5
        )
        try:
            proxy.start()
            yield Stack(precision, proxy, {r.id: r for r in replicas})
        finally:
            proxy.stop()
            redis.close()


def verified_reset(proxy: ProxyProcess, replica: str) -> dict[str, Any]:
    status, body = admin(proxy, "POST", f"/admin/replicas/{replica}/reset")
    if status != 200:
        raise RuntimeError(f"verified reset of {replica}: HTTP {status} {body}")
    return dict(body)


def eval_passes(s: Stack, arm: str, cache: str, episodes: list[Episode], runs: int) -> list[Pass]:
    """`runs` runs of an eval arm, each begun and ended through the admin API."""
    sdk = client(s.proxy, create_key(s.proxy.redis_url, arm, mode="eval", cache=cache))
    passes = []
    for k in range(1, runs + 1):
        started = time.perf_counter()
        run = begin(s.proxy, arm)
        played = play(sdk, episodes)
        end(s.proxy, run["id"])
        passes.append(Pass(played, time.perf_counter() - started, run["id"]))
        progress(
            f"{s.precision} {arm}: run {k} of {runs} ({run['id']} on {run['replica']}),"
            f" {passes[-1].seconds:.1f} s"
        )
    return passes


def shared_passes(s: Stack, episodes: list[Episode], runs: int) -> list[Pass]:
    """The workload `runs` times on a shared arm pinned to p1, from a freshly reset p1."""
    took = verified_reset(s.proxy, "p1")["duration_ms"]
    progress(f"{s.precision} shared: verified reset of p1, {took} ms")
    arm = f"shared-{s.precision}"
    sdk = client(
        s.proxy, create_key(s.proxy.redis_url, arm, mode="eval", cache="shared", replica="p1")
    )
    passes = []
    for k in range(1, runs + 1):
        started = time.perf_counter()
        run = begin(s.proxy, arm)
        played = play(sdk, episodes)
        end(s.proxy, run["id"])
        passes.append(Pass(played, time.perf_counter() - started, run["id"]))
        progress(f"{s.precision} shared: run {k} of {runs}, {passes[-1].seconds:.1f} s")
    return passes


def explain(s: Stack, run_a: str, run_b: str, limit: int) -> tuple[int, int]:
    """Proven and tried divergences of the pair, replayed through the proxy (a sample)."""
    response = HTTP.request(
        "POST",
        s.proxy.url + "/admin/runs/explain",
        body=orjson.dumps({"run_a": run_a, "run_b": run_b, "limit": limit}),
        headers={"Authorization": f"Bearer {s.proxy.admin_token}"},
        timeout=urllib3.Timeout(total=7200),
        preload_content=False,
    )
    for line in response:
        event = orjson.loads(line)
        if event["event"] == "result":
            report = event["report"]
            progress(f"{s.precision} explain {run_a} {run_b}: {report['proven']}/{report['tried']}")
            return int(report["proven"]), int(report["tried"])
        if event["event"] == "error":
            raise RuntimeError(f"explain {run_a} {run_b}: {event['error']['message']}")
    raise RuntimeError(f"explain {run_a} {run_b}: no result")


def save_snapshot(s: Stack, name: str, run: str, upto: int) -> None:
    status, body = admin(
        s.proxy, "POST", "/admin/snapshots", {"name": name, "from_run": run, "upto": upto}
    )
    if status != 201:
        raise RuntimeError(f"snapshot {name} from {run}: HTTP {status} {body}")
    progress(f"{s.precision}: saved snapshot {name} from {run}, first {upto} requests")


def summarize(s: Stack, arm: str, episodes: int, passes: list[Pass], sample: int) -> ArmResult:
    """Every later pass against the first one (causes, and a sample proved by replay); reuse
    over all passes' records."""
    result = ArmResult(s.precision, arm, episodes, reruns=len(passes) - 1)
    baseline = passes[0].played.records
    for k, other in enumerate(passes[1:], 2):
        diff = diff_runs(f"{arm}#1", baseline, f"{arm}#{k}", other.played.records)
        result.diverged += diff.diverged
        for cause in result.causes:
            result.causes[cause] += diff.caused(cause)
        classified = diff.caused("reuse") + diff.caused("state") + diff.caused("unexplained")
        if sample and classified and passes[0].run and other.run:
            proven, tried = explain(s, str(passes[0].run), str(other.run), sample)
            result.proven += proven
            result.tried += tried
    for p in passes:
        result.reused_blocks += sum(int(r.get("reused_blocks") or 0) for r in p.played.records)
        result.total_blocks += sum(int(r.get("total_blocks") or 0) for r in p.played.records)
        result.wall_s.append(p.seconds)
    return result


def study(s: Stack, episodes: list[Episode], args: argparse.Namespace) -> list[ArmResult]:
    """The four arms in order (off, shared, reset, replay)."""
    n, runs, p, k = len(episodes), args.runs, s.precision, args.explain
    results = [summarize(s, "off", n, eval_passes(s, f"off-{p}", "off", episodes, runs), k)]
    results.append(summarize(s, "shared", n, shared_passes(s, episodes, runs), k))
    reset_passes = eval_passes(s, f"reset-{p}", "reset", episodes, runs)
    results.append(summarize(s, "reset", n, reset_passes, k))
    snapshot = f"warm-{p}"
    save_snapshot(s, snapshot, str(reset_passes[0].run), args.snapshot_upto)
    replay = eval_passes(s, f"replay-{p}", f"replay:{snapshot}", episodes, runs)
    results.append(summarize(s, "replay", n, replay, k))
    for r in results:
        progress(f"{p} {r.arm}: {r.diverged}/{r.compared} diverged, {r.proven}/{r.tried} proven")
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--episodes", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3, help="runs per arm (the first is baseline)")
    parser.add_argument("--precisions", default="bf16,int4", help="comma-separated")
    parser.add_argument("--snapshot-upto", type=int, default=40)
    parser.add_argument(
        "--explain", type=int, default=3, help="divergences per rerun proved by replay (0: none)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2 (a baseline and a rerun)")
    args.precisions = args.precisions.split(",")
    unknown = set(args.precisions) - set(get_args(Precision))
    if unknown:
        parser.error(f"unknown precision(s) {sorted(unknown)}; known: {get_args(Precision)}")
    return args


def main() -> None:
    args = parse_args()
    episodes = make_episodes(args.episodes)
    results: list[ArmResult] = []
    for precision in args.precisions:
        with stack(precision) as s:
            results += study(s, episodes, args)
    command = shlex.join([".venv/bin/python", "-m", "bench.eval_study", *sys.argv[1:]])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = markdown(results, command, when)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval-study.md").write_text(report)
    chart(results, args.out / "eval-study.png")
    print(report)
    progress(f"written {args.out / 'eval-study.md'} and {args.out / 'eval-study.png'}")


if __name__ == "__main__":
    main()
