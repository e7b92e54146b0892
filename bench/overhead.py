"""What the proxy costs every request, beside the floor of its stack and beside nginx.

Starts a trivial Triton model with the ``ensemble`` interface that answers at once (so only the
proxies are timed), a private Redis, ``kvledger serve`` with the ledger on (one process per
replica transport asked for), a bare aiohttp + uvloop pass-through (the floor of our stack) and
nginx with a keep-alive upstream when it is installed. Then interleaved rounds, the order of
targets reversed every other round, of: latency at concurrency 1, throughput at concurrency 32,
and time to the first streamed event, each run on every target back to back.
CPU per request comes from /proc (utime + stime of the target's processes over the measured
window), Redis commands per request from ``INFO commandstats`` over the kvledger windows and a
short ``MONITOR`` sample (sent vs inside Lua).
Every response is checked (status; for kvledger the lineage record); failures are reported and
never counted as latency. Writes docs/results/overhead.md.

    .venv/bin/python -m bench.overhead [--rounds 2] [--c1 1000] [--c32 2000] [--stream 400]
                                       [--transports http,grpc] [--out docs/results/overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from bench.overhead_client import Phase, run_phase
from bench.overhead_redis import MonitorSample, command_calls
from bench.overhead_report import Cell, Results, render
from bench.overhead_targets import (
    COMPLETIONS,
    GENERATE,
    Target,
    kvledger,
    nginx,
    passthrough,
    trivial_triton,
)
from router.cli.local import RedisServer, create_key

DIRECT = "Triton direct"
FLOOR = "aiohttp pass-through"
ROOT = Path(__file__).resolve().parents[1]


async def measure(targets: list[Target], args: argparse.Namespace, redis_url: str) -> Results:
    results = Results([t.name for t in targets])
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        for target in targets:  # warm-up: connections, caches, the proxies' first requests
            for stream in (False, True):
                await run_phase(
                    session, target, n=50, concurrency=8, stream=stream, max_tokens=args.max_tokens
                )
        for index in range(args.rounds):
            order = targets if index % 2 == 0 else targets[::-1]
            results.rounds.append(await _round(session, order, args, redis_url, results))
            print(f"round {index + 1} done", file=sys.stderr, flush=True)
        for target in targets:
            if target.kvledger:
                await _sample_redis(session, target, args, redis_url, results)
    return results


async def _round(
    session: aiohttp.ClientSession,
    order: list[Target],
    args: argparse.Namespace,
    redis_url: str,
    results: Results,
) -> dict[str, Cell]:
    """One round: each kind of phase run on every target back to back (so that the machine's
    drift, which moves every target's figures by a fifth within a minute here, falls between
    kinds of phase rather than between the targets compared)."""
    per = args.rounds
    kinds = (
        (args.c1 // per, 1, False),
        (args.c32 // per, 32, False),
        (args.stream // per, 1, True),
    )
    phases: dict[str, list[Phase]] = {target.name: [] for target in order}
    for n, concurrency, stream in kinds:
        for target in order:
            before = command_calls(redis_url) if target.kvledger else Counter[str]()
            phase = await run_phase(
                session,
                target,
                n=n,
                concurrency=concurrency,
                stream=stream,
                max_tokens=args.max_tokens,
            )
            phases[target.name].append(phase)
            if target.kvledger:
                delta = command_calls(redis_url)
                delta.subtract(before)
                results.executed.setdefault(target.name, Counter()).update(+delta)
                results.served[target.name] += n
    return {name: Cell(*kinds_done) for name, kinds_done in phases.items()}


async def _sample_redis(
    session: aiohttp.ClientSession,
    target: Target,
    args: argparse.Namespace,
    redis_url: str,
    results: Results,
) -> None:
    """Which commands the proxy sends and which run inside Lua, from 100 requests."""
    n = 100
    with MonitorSample(redis_url) as sample:
        await run_phase(session, target, n=n, concurrency=1, stream=False, max_tokens=1)
        await asyncio.sleep(0.5)  # the writer writes behind the response
    results.sent[target.name] = sample.sent
    results.in_lua[target.name] = sample.in_lua
    results.sampled[target.name] = n


def _header(args: argparse.Namespace, results: Results) -> list[str]:
    load = os.getloadavg()
    command = "python -m bench.overhead " + " ".join(sys.argv[1:])
    return [
        "# Proxy overhead: kvledger beside its stack's floor and nginx",
        "",
        f"Command: `{command.strip()}`. Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on "
        f"{os.cpu_count()} cores shared by client, proxies, Redis and Triton (load average "
        f"{load[0]:.2f} at the end; other work on the machine adds noise, so compare targets "
        f"within a round). Python {platform.python_version()}.",
        "",
        f"A trivial Triton model (`bench/overhead_model.py`: the ensemble's interface, "
        f"decoupled, answers at once with {args.max_tokens} tokens). One aiohttp client. "
        f"{args.rounds} interleaved rounds, the order of targets reversed every other round, "
        f"each kind of phase run on every target back to back; "
        f"per target in total: {args.c1} requests at concurrency 1 (latency), {args.c32} at "
        f"concurrency 32 (throughput, CPU per request), {args.stream} streamed at concurrency "
        f"1 (time to the first event). kvledger runs with the ledger on (Redis, records "
        f"checked in every response). Targets in round order: {', '.join(results.names)}.",
    ]


def _kvledger_targets(
    stack: contextlib.ExitStack, replica: object, redis_url: str, transports: list[str]
) -> list[Target]:
    key = create_key(redis_url, "bench")
    auth = {"Authorization": f"Bearer {key}"}
    targets = []
    for index, transport in enumerate(transports):
        chosen = None if transport == "default" else transport
        proxy = stack.enter_context(kvledger(replica, redis_url, chosen))  # type: ignore[arg-type]
        assert proxy.process is not None
        pids = [proxy.process.pid]
        label = f"kvledger {transport}"
        targets.append(Target(f"{label} /generate", proxy.url, GENERATE, pids, auth, True))
        if index == 0:
            targets.append(
                Target(f"{label} /v1/completions", proxy.url, COMPLETIONS, pids, auth, True)
            )
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--c1", type=int, default=1000, help="requests at concurrency 1")
    parser.add_argument("--c32", type=int, default=2000, help="requests at concurrency 32")
    parser.add_argument("--stream", type=int, default=400, help="streamed requests")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--transports",
        default="http,grpc",
        help="kvledger replica transports, one proxy each ('default': the config's default)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "overhead.md")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvl-overhead-"))
    redis = RedisServer()
    redis.start()
    try:
        with trivial_triton(root) as replica, contextlib.ExitStack() as stack:
            direct = Target(DIRECT, replica.http_url, GENERATE)
            targets = [direct]
            proxy = stack.enter_context(nginx(f"127.0.0.1:{replica.http_port}"))
            notes = [] if proxy else ["nginx is not installed: skipped (apt-get install nginx)"]
            targets += [proxy] if proxy else []
            floor = stack.enter_context(passthrough(replica.http_url))
            targets.append(floor)
            transports = args.transports.split(",")
            targets += _kvledger_targets(stack, replica, redis.url, transports)
            results = asyncio.run(measure(targets, args, redis.url))
            results.notes += notes
    finally:
        redis.close()
        shutil.rmtree(root, ignore_errors=True)
    text = render(results, DIRECT, FLOOR, _header(args, results))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
