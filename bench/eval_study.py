"""The eval study through the proxy: how often reruns diverge, by cache control, at 16 and 4 bits.

For each weight precision it starts three stand-in replicas (p1 and p2 with block reuse, p3
without), a private Redis and one proxy (`min_production_replicas = 1`), and plays the
80-episode agent workload (bench/workload.py) several times back to back through the openai
SDK for each arm:

- `off`: an eval key with `cache="off"` (served by p3, runs begun and ended explicitly);
- `production`: a production key, no runs: prefix-affinity routing, caching on, no control; p1
  and p2 get a verified reset before the first pass, later passes meet the warm caches;
- `reset`: an eval key with `cache="reset"` (every run begins on a verified reset);
- `replay`: an eval key with `cache="replay:warm-<precision>"`, the snapshot saved from the
  first `reset` run's first `--snapshot-upto` requests.

Each later run is compared with the arm's first run (router/run_diff.py): divergent episodes,
block reuse, wall time per run, and how many divergences cache state explains. At the first
precision it also times, on p1, the verified reset (admin API) against a raw unload + load of
the same replica.
It writes `eval-study.md` and `eval-study.png` under `--out` and prints the Markdown.

    .venv/bin/python -m bench.eval_study [--episodes 80] [--runs 3] [--precisions bf16,int4]
        [--snapshot-upto 40] [--reset-rounds 3] [--out docs/results]

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

from backends.sim.launcher import Replica, ReplicaSpec, config_snippet, launch, wait_ready
from backends.sim.repository import ModelSettings, Precision
from bench.eval_study_report import ArmResult, ResetTiming, chart, markdown
from bench.workload import Episode, make_episodes
from router.cli.local import ProxyProcess, RedisServer
from router.eval.diff import diff_runs
from tests.eval_helpers import Played, admin, begin, client, end, play
from tests.triton_helpers import reset as raw_reset

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
    sdk = client(s.proxy, s.proxy.create_key(arm, mode="eval", cache=cache))
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


def production_passes(s: Stack, episodes: list[Episode], runs: int) -> list[Pass]:
    """The workload `runs` times on a production key, from cold p1 and p2 (nothing is leased)."""
    for replica in ("p1", "p2"):
        took = verified_reset(s.proxy, replica)["duration_ms"]
        progress(f"{s.precision} production: verified reset of {replica}, {took} ms")
    sdk = client(s.proxy, s.proxy.create_key(f"production-{s.precision}"))
    passes = []
    for k in range(1, runs + 1):
        started = time.perf_counter()
        played = play(sdk, episodes)
        passes.append(Pass(played, time.perf_counter() - started))
        served = sorted({str(r["replica"]) for r in played.records})
        progress(
            f"{s.precision} production: pass {k} of {runs} (on {', '.join(served)}),"
            f" {passes[-1].seconds:.1f} s"
        )
    return passes


def save_snapshot(s: Stack, name: str, run: str, upto: int) -> None:
    status, body = admin(
        s.proxy, "POST", "/admin/snapshots", {"name": name, "from_run": run, "upto": upto}
    )
    if status != 201:
        raise RuntimeError(f"snapshot {name} from {run}: HTTP {status} {body}")
    progress(f"{s.precision}: saved snapshot {name} from {run}, first {upto} requests")


def summarize(precision: str, arm: str, episodes: int, passes: list[Pass]) -> ArmResult:
    """Every later pass against the first one; reuse over all passes' records."""
    result = ArmResult(precision, arm, episodes, reruns=len(passes) - 1)
    baseline = passes[0].played.records
    for k, other in enumerate(passes[1:], 2):
        diff = diff_runs(f"{arm}#1", baseline, f"{arm}#{k}", other.played.records)
        result.diverged += diff.diverged
        result.explained += diff.explained
        result.unexplained += diff.unexplained
    for p in passes:
        result.reused_blocks += sum(int(r.get("reused_blocks") or 0) for r in p.played.records)
        result.total_blocks += sum(int(r.get("total_blocks") or 0) for r in p.played.records)
        result.wall_s.append(p.seconds)
    return result


def study(
    s: Stack, episodes: list[Episode], args: argparse.Namespace, reset_rounds: int
) -> tuple[list[ArmResult], ResetTiming | None]:
    """The four arms in order (off, production, reset, replay), then the reset timing if asked."""
    n, runs, p = len(episodes), args.runs, s.precision
    results = [summarize(p, "off", n, eval_passes(s, f"off-{p}", "off", episodes, runs))]
    results.append(summarize(p, "production", n, production_passes(s, episodes, runs)))
    reset_passes = eval_passes(s, f"reset-{p}", "reset", episodes, runs)
    results.append(summarize(p, "reset", n, reset_passes))
    snapshot = f"warm-{p}"
    save_snapshot(s, snapshot, str(reset_passes[0].run), args.snapshot_upto)
    replay = eval_passes(s, f"replay-{p}", f"replay:{snapshot}", episodes, runs)
    results.append(summarize(p, "replay", n, replay))
    for r in results:
        progress(f"{p} {r.arm}: {r.diverged}/{r.compared} diverged, {r.explained} explained")
    timing = time_resets(s, reset_rounds) if reset_rounds > 0 else None
    return results, timing


def time_resets(s: Stack, rounds: int) -> ResetTiming:
    """Alternate the verified reset of p1 and a raw unload + load of it, `rounds` times each."""
    replica = s.replicas["p1"]
    timing = ResetTiming(replica.id)
    for k in range(1, rounds + 1):
        started = time.perf_counter()
        verified_reset(s.proxy, replica.id)
        timing.verified_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        raw_reset(replica)
        wait_ready([replica])
        timing.raw_s.append(time.perf_counter() - started)
        progress(
            f"{s.precision} reset timing round {k} of {rounds}: verified"
            f" {timing.verified_s[-1]:.2f} s, raw {timing.raw_s[-1]:.2f} s"
        )
        time.sleep(1.5)  # let the proxy's monitor see the replica ready again
    return timing


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--episodes", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3, help="runs per arm (the first is baseline)")
    parser.add_argument("--precisions", default="bf16,int4", help="comma-separated")
    parser.add_argument("--snapshot-upto", type=int, default=40)
    parser.add_argument("--reset-rounds", type=int, default=3)
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
    timing: ResetTiming | None = None
    for precision in args.precisions:
        with stack(precision) as s:
            rounds = args.reset_rounds if timing is None else 0  # timed at one precision
            arms, measured = study(s, episodes, args, rounds)
        results += arms
        timing = timing or measured
    command = shlex.join([".venv/bin/python", "-m", "bench.eval_study", *sys.argv[1:]])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = markdown(results, timing, command, when)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval-study.md").write_text(report)
    chart(results, args.out / "eval-study.png")
    print(report)
    progress(f"written {args.out / 'eval-study.md'} and {args.out / 'eval-study.png'}")


if __name__ == "__main__":
    main()
