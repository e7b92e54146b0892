"""What a verified reset costs beyond the reload itself, measured side by side.

    python -m bench.reset_timing [--rounds 5] [--proxies 2] [--out docs/results]

Starts one stand-in replica, a private Redis and ``--proxies`` kvledger instances on it, then
alternates, ``--rounds`` times each: a verified reset through the first proxy's admin API
(mark, announce, every other proxy's acknowledgement, drain, unload + load, counters and
used blocks confirmed at zero, new generation) and a raw unload + load of the same replica
through Triton's repository API (the floor: what emptying a TensorRT-LLM cache costs at all).
Prints both medians and their ratio, and writes ``reset-timing.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson
import tritonclient.http as httpclient
import urllib3

from backends.sim.launcher import Replica, ReplicaSpec, config_snippet, launch
from backends.sim.repository import MODEL_NAME
from router.cli.local import ProxyProcess, RedisServer

HTTP = urllib3.PoolManager()


def verified(proxy: ProxyProcess, replica: str) -> float:
    began = time.perf_counter()
    response = HTTP.request(
        "POST",
        f"{proxy.url}/admin/replicas/{replica}/reset",
        headers={"Authorization": f"Bearer {proxy.admin_token}"},
        timeout=urllib3.Timeout(total=300),
    )
    if response.status != 200:
        raise RuntimeError(f"verified reset: HTTP {response.status} {response.data[:200]!r}")
    return time.perf_counter() - began


def raw(replica: Replica) -> float:
    """Unload, wait until the index says no model READY or UNLOADING, load (blocks).

    Every model, not only the ensemble: the ensemble is UNAVAILABLE at once, the models it is
    composed of (the engine among them) a second or so later, and a load issued while the
    engine is still UNLOADING may keep it, cache and all (``backends.triton_control``)."""
    client = httpclient.InferenceServerClient(replica.http_url.removeprefix("http://"))
    began = time.perf_counter()
    try:
        client.unload_model(MODEL_NAME, unload_dependents=True)
        while True:
            states = [m.get("state") for m in client.get_model_repository_index()]
            if all(state not in ("READY", "UNLOADING") for state in states):
                break
            time.sleep(0.05)
        client.load_model(MODEL_NAME)
    finally:
        client.close()
    return time.perf_counter() - began


def measure(rounds: int, proxies: int) -> tuple[list[float], list[float]]:
    redis = RedisServer()
    redis.start()
    try:
        with launch([ReplicaSpec("t1")]) as running:
            replica = running[0]
            extra = "[eval]\nmin_production_replicas = 0"
            stack = [
                ProxyProcess(config_snippet(running), redis.url, extra=extra, monitor_interval_s=2)
                for _ in range(proxies)
            ]
            for proxy in stack:
                proxy.start()
            time.sleep(3)  # every proxy's monitor has announced itself alive
            try:
                return alternate(stack[0], replica, rounds)
            finally:
                for proxy in stack:
                    proxy.stop()
    finally:
        redis.close()


def alternate(
    proxy: ProxyProcess, replica: Replica, rounds: int
) -> tuple[list[float], list[float]]:
    kept: dict[str, list[float]] = {"verified": [], "raw": []}
    ways = {"verified": lambda: verified(proxy, replica.id), "raw": lambda: raw(replica)}
    for k in range(rounds):
        for name in ("verified", "raw") if k % 2 == 0 else ("raw", "verified"):
            kept[name].append(ways[name]())
        print(
            f"round {k + 1} of {rounds}: verified {kept['verified'][-1]:.2f} s,"
            f" raw {kept['raw'][-1]:.2f} s",
            flush=True,
        )
    return kept["verified"], kept["raw"]


def report(v: list[float], r: list[float], proxies: int, command: str) -> str:
    ratio = statistics.median(v) / statistics.median(r)
    rows = "\n".join(
        f"| {i + 1} | {a:.2f} s | {b:.2f} s |" for i, (a, b) in enumerate(zip(v, r, strict=True))
    )
    return (
        "# Verified reset against a raw unload + load\n\n"
        f"Measured {datetime.now(UTC):%Y-%m-%d} with `{command}`: one CPU stand-in replica,"
        f" {proxies} kvledger proxy instance(s) on one Redis, monitor interval 2 s; rounds"
        " alternate which goes first.\n\n| round | verified reset | raw unload + load |\n"
        f"|---|---|---|\n{rows}\n\nMedian verified {statistics.median(v):.2f} s, raw"
        f" {statistics.median(r):.2f} s: **ratio {ratio:.3f}**.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--proxies", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    v, r = measure(args.rounds, args.proxies)
    command = f"python -m bench.reset_timing --rounds {args.rounds} --proxies {args.proxies}"
    text = report(v, r, args.proxies, command)
    print(text)
    if args.out is not None:
        (args.out / "reset-timing.md").write_text(text)
        print(orjson.dumps({"verified": v, "raw": r}).decode())


if __name__ == "__main__":
    main()
