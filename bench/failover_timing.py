"""What moving an eval run costs, beside what serving its requests cost.

    python -m bench.failover_timing [--requests 50] [--rounds 3] [--out docs/results]

Starts two stand-in replicas with block reuse, a private Redis and one kvledger instance
(``min_production_replicas = 0``). Per round: a ``reset`` arm's run is begun (its reset is not
timed), serves ``--requests`` requests (multi-turn episodes of ``bench.workload``, one at a
time, timed from the first to the last answer), then ``POST /admin/replicas/{id}/move-runs``
moves the run to the other replica (verified reset, replay of the run's history, fingerprint
and outputs checked), and the run record's move gives its parts. Prints the medians side by
side and writes ``failover-timing.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import orjson
import urllib3

from backends.sim.launcher import ReplicaSpec, config_snippet, launch
from bench.workload import DEFAULT_MAX_TOKENS, make_episodes
from router.cli.local import ProxyProcess, RedisServer, create_key

HTTP = urllib3.PoolManager()
ARM = "failover-bench"


def _admin(proxy: ProxyProcess, method: str, path: str) -> Any:
    response = HTTP.request(
        method,
        proxy.url + path,
        headers={"Authorization": f"Bearer {proxy.admin_token}"},
        timeout=urllib3.Timeout(total=900),
    )
    if response.status >= 300:
        raise RuntimeError(f"{path}: HTTP {response.status} {response.data[:300]!r}")
    return orjson.loads(response.data)


def serve(sdk: openai.OpenAI, n: int) -> tuple[str, float]:
    """``n`` requests of multi-turn episodes, in order: the run and the seconds they took."""
    episodes, done, run = iter(make_episodes(80)), 0, ""
    began = time.perf_counter()
    while done < n:
        episode = next(episodes)
        outputs: list[str] = []
        for _ in range(min(episode.turns, n - done)):
            raw = sdk.completions.with_raw_response.create(
                model="ensemble", prompt=episode.render(outputs), max_tokens=DEFAULT_MAX_TOKENS
            )
            outputs.append(raw.parse().choices[0].text)
            run = raw.headers["X-Kvl-Run"]
            done += 1
    return run, time.perf_counter() - began


def one_round(proxy: ProxyProcess, sdk: openai.OpenAI, n: int) -> dict[str, float]:
    body = orjson.dumps({"arm": ARM})
    response = HTTP.request(
        "POST",
        proxy.url + "/admin/runs",
        body=body,
        headers={"Authorization": f"Bearer {proxy.admin_token}"},
        timeout=urllib3.Timeout(total=900),
    )
    if response.status != 201:  # begun before timing: its reset is not part of serving
        raise RuntimeError(f"begin: HTTP {response.status} {response.data[:300]!r}")
    run, served = serve(sdk, n)
    replica = _admin(proxy, "GET", f"/admin/runs/{run}")["run"]["replica"]
    body = _admin(proxy, "POST", f"/admin/replicas/{replica}/move-runs")
    entry = next(e for e in body["runs"] if e["run"] == run)
    if not entry["moved"]:
        raise RuntimeError(f"run {run} did not move: {entry['reason']}")
    move = entry["move"]
    _admin(proxy, "POST", f"/admin/replicas/{replica}/undrain")
    _admin(proxy, "POST", f"/admin/runs/{run}/end")
    return {
        "served_s": served,
        "move_s": float(move["seconds"]),
        "reset_s": float(move["reset_s"]),
        "replay_s": float(move["replay_s"]),
        "replayed": float(move["replayed"]),
    }


def measure(n: int, rounds: int) -> list[dict[str, float]]:
    redis = RedisServer()
    redis.start()
    try:
        with launch([ReplicaSpec("t1"), ReplicaSpec("t2")]) as running:
            extra = "[eval]\nmin_production_replicas = 0"
            proxy = ProxyProcess(config_snippet(running), redis.url, extra=extra)
            proxy.start()
            try:
                key = create_key(redis.url, ARM, mode="eval", cache="reset")
                sdk = openai.OpenAI(
                    base_url=proxy.url + "/v1", api_key=key, timeout=600, max_retries=0
                )
                return [one_round(proxy, sdk, n) for _ in range(rounds)]
            finally:
                proxy.stop()
    finally:
        redis.close()


def report(n: int, results: list[dict[str, float]]) -> str:
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "# Failover timing",
            "",
            f"Measured {stamp} with `python -m bench.failover_timing --requests {n}"
            f" --rounds {len(results)}` (medians; two stand-in replicas, one proxy, 2 cores).",
            "",
            "| what | seconds |",
            "|---|---|",
            f"| serving the run's {n} requests | {med['served_s']:.2f} |",
            f"| moving the run (lease, reset, replay, checks) | {med['move_s']:.2f} |",
            f"| of which the verified reset | {med['reset_s']:.2f} |",
            f"| of which the replay of {med['replayed']:.0f} requests | {med['replay_s']:.2f} |",
            "",
            f"Move / serving: {med['move_s'] / med['served_s']:.2f}x;"
            f" replay / serving: {med['replay_s'] / med['served_s']:.2f}x.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write failover-timing.md there")
    args = parser.parse_args()
    text = report(args.requests, measure(args.requests, args.rounds))
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "failover-timing.md").write_text(text)


if __name__ == "__main__":
    main()
