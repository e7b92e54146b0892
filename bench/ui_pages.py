"""How fast the /ui/ page opens a run of 100,000 requests, and how long an export of it takes.

    python -m bench.ui_pages [--records 100000]

Starts a private Redis, one stand-in replica and a proxy; writes a run of N records (the
shapes an eval run writes: its meta, its lineage index, its kept inputs with outputs) straight
into Redis, then times over HTTP the run's first page, a page near its end (``after=``) and
the Runs list (median of 5 each), and ``kvledger export --run`` to Parquet and JSON Lines.
Prints one line per figure. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
import urllib3

from backends.sim.launcher import ReplicaSpec, config_snippet, launch
from router.cli.local import ProxyProcess, RedisServer
from router.ledger.records import stamp
from router.ledger.runs import RunStore, requests_key
from router.ledger.schema import run_lineage_key

RUN = "bench-ui.1"
TOKEN = "admin-secret"


def record(i: int, now: float) -> dict[str, Any]:
    return {
        "request_id": f"{i:024x}",
        "at": stamp(now + i / 1000),
        "key": "bench-ui",
        "mode": "eval",
        "arm": "bench-ui",
        "run": RUN,
        "episode": str(i // 10),
        "replica": "r1",
        "model": "ensemble",
        "engine_digest": "e" * 64,
        "generation": 7,
        "verified": True,
        "warning": None,
        "pending": False,
        "digest": f"{i:064x}",
        "prompt_digest": f"{i:064x}",
        "params_digest": "p" * 64,
        "output_digest": f"{i + 1:064x}",
        "reused_blocks": i % 40,
        "total_blocks": 48,
        "new_blocks": 48 - i % 40,
        "cached_tokens": 16 * (i % 40),
        "prompt_tokens": 700,
        "completion_tokens": 20,
        "status": "ok",
        "latency_ms": 18.5,
        "ttft_ms": 4.25,
        "policy": "eval",
        "reason": "rendezvous rank 1 of 1 for arm 'bench-ui'",
        "seq": i,
        "state_before": f"{i:064x}",
        "state_after": f"{i + 1:064x}",
        "state_known": True,
        "stale": False,
        "unordered": False,
        "exact": True,
        "durable": True,
    }


async def fill(url: str, n: int) -> None:
    client = aioredis.Redis.from_url(url)
    now = time.time()
    try:
        await RunStore(client).create(
            RUN,
            {"id": RUN, "arm": "bench-ui", "cache": "reset", "status": "ended", "replica": "r1"},
            int(now * 1000),
        )
        for low in range(0, n, 5000):
            pipe = client.pipeline(transaction=False)
            for i in range(low, min(n, low + 5000)):
                r = record(i, now)
                pipe.xadd(run_lineage_key(RUN), {"r": orjson.dumps(r)})
                kept = {"request_id": r["request_id"], "prompt": "A: ls " * 40, "output": "x" * 20}
                pipe.xadd(requests_key(RUN), {"e": orjson.dumps(kept)})
            await pipe.execute()
    finally:
        await client.aclose()


def timed_get(http: urllib3.PoolManager, url: str, tries: int = 5) -> float:
    took = []
    for _ in range(tries):
        started = time.perf_counter()
        response = http.request("GET", url, headers={"Authorization": f"Bearer {TOKEN}"})
        took.append(time.perf_counter() - started)
        assert response.status == 200, response.data[:300]
        assert response.data.count(b"/requests/") in (0, 100), "a run page shows 100 requests"
    return statistics.median(took)


def timed_export(redis_url: str, fmt: str, out: Path) -> float:
    command = [sys.executable, "-m", "router.cli", "export", "--run", RUN, "--format", fmt]
    command += ["--out", str(out), "--redis-url", redis_url, "--quiet"]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    redis = RedisServer()
    redis.start()
    try:
        with launch([ReplicaSpec("r1")]) as replicas:
            asyncio.run(fill(redis.url, args.records))
            proxy = ProxyProcess(config_snippet(replicas), redis.url)
            proxy.start()
            try:
                http = urllib3.PoolManager()
                base = f"{proxy.url}/ui/runs"
                late = f"{int(time.time() * 1000) + args.records}-0"
                first = timed_get(http, f"{base}/{RUN}")
                print(f"run page (first 100 of {args.records}): {first:.3f} s")
                before = f"{base}/{RUN}?before={late}"
                print(f"run page (last 100, before=): {timed_get(http, before):.3f} s")
                print(f"runs list: {timed_get(http, base):.3f} s")
            finally:
                proxy.stop()
            out = Path(tempfile.mkdtemp(prefix="kvl-bench-ui-"))
            for fmt in ("parquet", "jsonl"):
                took = timed_export(redis.url, fmt, out / f"run.{fmt}")
                size = (out / f"run.{fmt}").stat().st_size
                print(f"export {args.records} records to {fmt}: {took:.2f} s, {size:,} bytes")
    finally:
        redis.close()


if __name__ == "__main__":
    main()
