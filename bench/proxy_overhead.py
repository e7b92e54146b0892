"""What kvledger adds: latency and throughput direct to a replica vs through the proxy.

Starts a private Redis, one stand-in replica and the proxy (``kvledger serve`` in its own
process), then alternates rounds of identical requests sent straight to the replica's
``/generate`` (``/generate_stream``) and to the proxy's, non-streamed and streamed, at
concurrency 1 and 32. Rounds alternate so that drift on a shared machine hits both sides alike;
the table prints both sides and their ratio, measured in the same run.

    .venv/bin/python -m bench.proxy_overhead [--requests 300] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from backends.sim.launcher import ReplicaSpec, config_snippet, launch
from router.cli.local import ProxyProcess, RedisServer


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0

    def p(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


async def one(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], headers: dict[str, str]
) -> float:
    start = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
    return time.perf_counter() - start


async def round_(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    n: int,
    concurrency: int,
    max_tokens: int,
    into: Samples,
) -> None:
    body = {
        "text_input": "The benchmark prompt, the same every time, so the cache serves it.",
        "max_tokens": max_tokens,
    }
    queue = list(range(n))

    async def worker() -> None:
        while queue:
            queue.pop()
            into.latencies.append(await one(session, url, body, headers))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    into.elapsed += time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    direct: str, proxied: str, key: str, proxy_pid: int, args: argparse.Namespace
) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        print(
            f"{'mode':<12}{'conc':>5}{'direct p50':>12}{'proxy p50':>11}{'added p50':>11}"
            f"{'direct p99':>12}{'proxy p99':>11}{'rps ratio':>11}{'proxy cpu/req':>15}"
        )
        for path in ("generate", "generate_stream"):
            for concurrency in (1, 32):
                sides = {"direct": Samples(), "proxy": Samples()}
                cpu = 0.0
                for _name, base, headers in (("direct", direct, {}), ("proxy", proxied, auth)):
                    await round_(
                        session,
                        f"{base}/v2/models/ensemble/{path}",
                        headers,
                        20,
                        concurrency,
                        args.max_tokens,
                        Samples(),
                    )  # warm-up
                for _ in range(args.rounds):
                    for name, base, headers in (("direct", direct, {}), ("proxy", proxied, auth)):
                        before = cpu_seconds(proxy_pid)
                        await round_(
                            session,
                            f"{base}/v2/models/ensemble/{path}",
                            headers,
                            args.requests // args.rounds,
                            concurrency,
                            args.max_tokens,
                            sides[name],
                        )
                        if name == "proxy":
                            cpu += cpu_seconds(proxy_pid) - before
                d, p = sides["direct"], sides["proxy"]
                print(
                    f"{path:<12}{concurrency:>5}{d.p(0.5):>10.2f}ms{p.p(0.5):>9.2f}ms"
                    f"{p.p(0.5) - d.p(0.5):>9.2f}ms{d.p(0.99):>10.2f}ms{p.p(0.99):>9.2f}ms"
                    f"{p.rps / d.rps:>11.2f}{cpu / len(p.latencies) * 1000:>13.2f}ms"
                )
        print(
            f"(median of per-request latency; {args.requests} requests per cell, "
            f"{args.max_tokens} tokens each; rps ratio = proxy throughput / direct)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    redis = RedisServer()
    redis.start()
    try:
        with launch([ReplicaSpec("r1")]) as replicas:
            proxy = ProxyProcess(
                config_snippet(replicas), redis.url, policy="least_loaded", monitor_interval_s=0.5
            )
            proxy.start()
            try:
                key = proxy.create_key("bench")
                assert proxy.process is not None
                pid = proxy.process.pid
                asyncio.run(measure(replicas[0].http_url, proxy.url, key, pid, args))
            finally:
                proxy.stop()
    finally:
        redis.close()


if __name__ == "__main__":
    main()
