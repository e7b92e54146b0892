"""The ledger's chain step against one Redis, one Redis with WAIT, and a 3-master cluster, side
by side in one run: ``python -m bench.ledger_scale``.

Each setup gets a fresh set of real ``redis-server`` processes and one :class:`Ledger` (one
proxy's view: its one wire, or one wire per master on the cluster), stepping the chains of
``--replicas`` replicas:

- *throughput*: ``--steps`` production chain steps with ``--concurrency`` in flight (many
  requests finishing at once, as a loaded proxy does), in chain steps per second;
- *added p50*: ``--serial`` steps one at a time, the median time a request waits on its chain
  step (what the ledger adds to a request's latency).

The setups: ``1 node`` (appendonly on, no replica), ``1 node + WAIT`` (a replica;
``production_wait_ms`` on, so every step waits for the replica's acknowledgement), ``cluster``
(3 masters, 1 replica each, no WAIT) and ``cluster + WAIT``. One proxy process drives each, so
the cluster's figure is what one proxy gets from it; the cluster's gain is capacity for many
proxies (each master takes a third of the steps), which one client on a 2-core machine cannot
show: see docs/results/ledger-scale.md for the arithmetic. Times vary with the machine; compare
the rows of one run. *Redis µs/step* is Redis' own time in the step's script (``INFO
commandstats``), the figure that sizes a fleet's masters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from router.cli.cluster import LocalCluster, RedisReplica
from router.cli.local import RedisServer
from router.ledger import Ledger, LedgerConfig
from router.ledger.chain import request_digest, text_digest
from router.ledger.connect import connect, is_cluster

ENGINE = "bench|ensemble|v1"


def _record(i: int, replica: str, generation: int) -> dict[str, Any]:
    output = f"answer {i}"
    return {
        "request_id": f"{replica}-{i:07d}",
        "replica": replica,
        "generation": generation,
        "engine_digest": ENGINE,
        "run": None,
        "warning": None,
        "pending": False,
        "digest": request_digest("ensemble", f"prompt {i}", {"seed": i}, output),
        "output_digest": text_digest(output),
        "status": "ok",
    }


async def _measure(url: str, args: argparse.Namespace, wait_ms: int) -> dict[str, float]:
    client = connect(url, timeout_s=5, connect_timeout_s=5)
    spool = Path(tempfile.mkdtemp(prefix="kvl-bench-")) / "spool.jsonl"
    config = LedgerConfig(spool_path=spool, redis_timeout_s=5.0, production_wait_ms=wait_ms)
    ledger = Ledger(client, config, structlog.get_logger("kvledger.bench"))
    await ledger.start()
    try:
        replicas = [f"r{i}" for i in range(args.replicas)]
        generations = {}
        for replica in replicas:
            head = await ledger.ensure_replica(replica, ENGINE, proven_empty=True, counter=0)
            generations[replica] = head.generation
        counter = iter(range(10**9))

        async def one() -> float:
            i = next(counter)
            replica = replicas[i % len(replicas)]
            start = time.perf_counter()
            done = await ledger.commit(_record(i, replica, generations[replica]))
            if done["pending"]:
                raise RuntimeError("a step went to the spool: the measurement is void")
            if wait_ms and done.get("durable") is not True:
                raise RuntimeError(f"a step was not acknowledged by a replica: {done}")
            return time.perf_counter() - start

        for _ in range(200):  # warm up: connections, script cache
            await one()
        serial = [await one() for _ in range(args.serial)]
        queue = iter(range(args.steps))

        async def worker() -> None:
            for _ in queue:
                await one()

        before = await _script_usec(client)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
        after = await _script_usec(client)
        return {
            "steps_per_s": args.steps / elapsed,
            "redis_us": (after[0] - before[0]) / max(1, after[1] - before[1]),
            "p50_ms": statistics.median(serial) * 1000,
            "p99_ms": sorted(serial)[int(len(serial) * 0.99) - 1] * 1000,
        }
    finally:
        await ledger.close()
        await client.aclose()


async def _script_usec(client: Any) -> tuple[float, int]:
    """Redis' own time in the chain step's script (``EVALSHA``, ``INFO commandstats``) summed
    over the masters, and its calls: Redis CPU per step, whatever the client's speed."""
    if is_cluster(client):
        per_node = await client.info("commandstats", target_nodes="primaries")
        stats = list(per_node.values())
    else:
        stats = [await client.info("commandstats")]
    usec = sum(float(s.get("cmdstat_evalsha", {}).get("usec", 0)) for s in stats)
    calls = sum(int(s.get("cmdstat_evalsha", {}).get("calls", 0)) for s in stats)
    return usec, calls


@contextlib.contextmanager
def _single(replica: bool) -> Iterator[str]:
    server = RedisServer(appendonly=True)
    server.start()
    follower = RedisReplica(server.port) if replica else None
    try:
        if follower is not None:
            follower.start()
        yield server.url
    finally:
        if follower is not None:
            follower.close()
        server.close()


@contextlib.contextmanager
def _cluster() -> Iterator[str]:
    cluster = LocalCluster(3, 1)
    cluster.start()
    try:
        yield cluster.url
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_scale", description=__doc__)
    parser.add_argument("--steps", type=int, default=20_000, help="steps for the throughput")
    parser.add_argument("--concurrency", type=int, default=64, help="steps in flight")
    parser.add_argument("--serial", type=int, default=2_000, help="steps one at a time (p50)")
    parser.add_argument("--replicas", type=int, default=30, help="chains stepped")
    parser.add_argument("--wait-ms", type=int, default=1000, help="WAIT's timeout when on")
    args = parser.parse_args(argv)
    setups: list[tuple[str, Callable[[], contextlib.AbstractContextManager[str]], int]] = [
        ("1 node", lambda: _single(False), 0),
        ("1 node + WAIT", lambda: _single(True), args.wait_ms),
        ("cluster (3 masters)", _cluster, 0),
        ("cluster + WAIT", _cluster, args.wait_ms),
    ]
    rows = []
    for name, start, wait_ms in setups:
        with start() as url:
            rows.append((name, asyncio.run(_measure(url, args, wait_ms))))
    base = rows[0][1]
    print(
        f"{args.steps} steps, {args.concurrency} in flight, {args.replicas} replicas; "
        f"p50/p99 of {args.serial} serial steps\n"
    )
    print("| setup | chain steps/s | vs 1 node | added p50 ms | added p99 ms | Redis µs/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows:
        ratio = row["steps_per_s"] / base["steps_per_s"]
        print(
            f"| {name} | {row['steps_per_s']:,.0f} | {ratio:.2f}x | {row['p50_ms']:.3f} | "
            f"{row['p99_ms']:.3f} | {row['redis_us']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
