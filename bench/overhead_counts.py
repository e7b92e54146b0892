"""What the proxy costs every request, counted rather than timed: instructions and system calls.

``bench/overhead.py`` times CPU from /proc, which a shared machine makes noisy (other guests,
other work): two rounds of the same code differ by a fifth. This benchmark counts instead, in
front of the same trivial Triton model, for the bare pass-through (the issue's floor), kvledger's
plumbing alone (``bench/overhead_plumbing.py``: its server, replica and Redis wires, none of
its own work), and kvledger with the ledger on:

- user-space instructions per request, from callgrind (valgrind), counted only while the
  measured requests run (instrumentation switched on after a warm-up), net of what the process
  does meanwhile with no request (its background, counted over an idle window as long):
  repeatable to a few percent (how a replica's events fall into reads varies), whatever else
  the machine does, but blind to the kernel;
- system calls per request, from ``strace -c`` on a separate, unslowed run: the kernel side.

Prints both, with ratios to the floor, and writes ``docs/results/overhead-counts.md``. Needs
``valgrind`` and ``strace`` (``apt-get install valgrind strace``); stops with a message if
either is missing.

    .venv/bin/python -m bench.overhead_counts [--requests 400] [--concurrency 8] [--warmup 100]
                                              [--out docs/results/overhead-counts.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.overhead_client import run_phase
from bench.overhead_targets import (
    GENERATE,
    Target,
    kvledger,
    passthrough,
    plumbing,
    trivial_triton,
)
from router.cli.local import RedisServer, create_key

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "aiohttp pass-through"
PLUMBING = "kvledger's plumbing alone"
KVLEDGER = "kvledger http /generate"


@dataclass
class Counts:
    instructions: float = 0.0  # per request, net of the background
    background: float = 0.0  # per request: what the process did meanwhile with no request
    syscalls: Counter[str] | None = None  # per request, by name


def load(target: Target, requests: int, concurrency: int) -> None:
    """``requests`` checked requests to ``target``; any failure stops the benchmark."""

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            phase = await run_phase(
                session, target, n=requests, concurrency=concurrency, stream=False, max_tokens=4
            )
        if phase.failures:
            failed = len(phase.failures)
            raise SystemExit(f"{target.name}: {failed} failed, e.g. {phase.failures[0]}")

    asyncio.run(run())


def callgrind(
    pid: int, out_prefix: Path, measured: Callable[[], None], requests: int
) -> tuple[float, float]:
    """Instructions per request of ``measured()``, net of the process's background, and that
    background per request.

    Background: what the process does with no request at all (kvledger's monitor ticks every
    ``monitor_interval_s``), counted over an idle window as long as the measured one. Under
    valgrind the requests take some fifty times longer than they would, so a time-driven cost
    would otherwise be charged to them fifty times over."""
    subprocess.run(["callgrind_control", "-i", "on", str(pid)], capture_output=True, timeout=300)
    start = time.monotonic()
    measured()
    window = time.monotonic() - start
    loaded = _dump(pid, out_prefix)
    time.sleep(window)
    idle = _dump(pid, out_prefix)
    return (loaded - idle) / requests, idle / requests


def _dump(pid: int, out_prefix: Path) -> int:
    """The instructions counted since the last dump (or since counting began)."""
    # A dump is written as the process runs on, so wait for its totals line.
    subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, timeout=300)
    found = None
    for _ in range(600):
        dumps = sorted(out_prefix.parent.glob(f"{out_prefix.name}.{pid}*"), key=os.path.getmtime)
        text = dumps[-1].read_text(errors="replace") if dumps else ""
        found = re.search(r"^(?:summary|totals):\s*(\d+)", text, re.MULTILINE)
        if found is not None:
            break
        time.sleep(0.1)
    if found is None:
        raise SystemExit(f"no callgrind totals for pid {pid} in {out_prefix.parent}")
    for dump in dumps:
        dump.unlink()
    return int(found.group(1))


def strace(pid: int, workdir: Path, measured: Callable[[], None], requests: int) -> Counter[str]:
    """System calls per request of ``measured()``, by name (every thread of ``pid``)."""
    out = workdir / f"strace.{pid}"
    tracer = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(pid), "-o", str(out)], stderr=subprocess.DEVNULL
    )
    time.sleep(1.0)  # attached to every thread
    measured()
    tracer.send_signal(signal.SIGINT)
    tracer.wait(timeout=60)
    calls: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        parts = line.split()
        # "% time  seconds  usecs/call  calls  [errors]  syscall"
        if len(parts) >= 5 and parts[3].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return Counter({name: count / requests for name, count in calls.items()})


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Counts]:
    counts = {name: Counts() for name in (FLOOR, PLUMBING, KVLEDGER)}
    prefix = workdir / "callgrind.out"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind += [f"--callgrind-out-file={prefix}.%p", sys.executable]
    redis = RedisServer()
    redis.start()
    try:
        with trivial_triton(workdir) as replica:
            key = create_key(redis.url, "bench")
            auth = {"Authorization": f"Bearer {key}"}
            for tool, python in (("callgrind", valgrind), ("strace", None)):
                with passthrough(replica.http_url, python) as floor:
                    _count(tool, counts[FLOOR], floor, floor.pids[0], args, prefix, workdir)
                with plumbing(replica.http_url, redis.port, python) as lean:
                    pid = lean.pids[0]
                    _count(tool, counts[PLUMBING], lean, pid, args, prefix, workdir)
                with kvledger(replica, redis.url, "http", python) as proxy:
                    assert proxy.process is not None
                    pid = proxy.process.pid
                    target = Target(KVLEDGER, proxy.url, GENERATE, headers=auth, kvledger=True)
                    _count(tool, counts[KVLEDGER], target, pid, args, prefix, workdir)
                print(f"{tool}: done", file=sys.stderr, flush=True)
    finally:
        redis.close()
    return counts


def _count(
    tool: str,
    into: Counts,
    target: Target,
    pid: int,
    args: argparse.Namespace,
    prefix: Path,
    workdir: Path,
) -> None:
    load(target, args.warmup, args.concurrency)  # connections, caches, first requests

    def measured() -> None:
        load(target, args.requests, args.concurrency)

    if tool == "callgrind":
        into.instructions, into.background = callgrind(pid, prefix, measured, args.requests)
    else:
        into.syscalls = strace(pid, workdir, measured, args.requests)


def render(counts: dict[str, Counts], args: argparse.Namespace) -> str:
    floor = counts[FLOOR]
    per_target = [c.syscalls or Counter[str]() for c in counts.values()]
    names = sorted({name for calls in per_target for name in calls})
    shown = [n for n in names if any(calls[n] >= 0.05 for calls in per_target)]
    lines = [
        "# Proxy overhead, counted: instructions and system calls per request",
        "",
        f"Command: `python -m bench.overhead_counts --requests {args.requests} --concurrency "
        f"{args.concurrency}`. Measured {time.strftime('%Y-%m-%d %H:%M %Z')}. The trivial "
        "Triton model of `bench/overhead.py`; non-streamed requests, every response checked. "
        "Instructions: user space only (callgrind, counted while the measured requests ran), "
        "net of the process's background: what it did in an idle window as long as the "
        "measured one (kvledger's monitor), shown apart, per request, in the last column; "
        "valgrind slows the requests about fiftyfold, not the monitor's clock. "
        "System calls: `strace -c` on a separate run, every thread of the process.",
        "",
        "| target | instructions per request | vs floor | system calls per request | vs floor |"
        + "".join(f" {n} |" for n in shown)
        + " background instructions, subtracted |",
        "|---|---|---|---|---|" + "---|" * (len(shown) + 1),
    ]
    floor_calls = sum((floor.syscalls or Counter[str]()).values())
    for name, c in counts.items():
        calls = c.syscalls or Counter[str]()
        total = sum(calls.values())
        ratio = c.instructions / floor.instructions
        lines.append(
            f"| {name} | {c.instructions / 1000:,.0f}k | {ratio:.2f}× "
            f"| {total:.2f} | {total / floor_calls:.2f}× |"
            + "".join(f" {calls.get(n, 0.0):.2f} |" for n in shown)
            + f" {c.background / 1000:,.1f}k |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100, help="requests before counting")
    out = ROOT / "docs" / "results" / "overhead-counts.md"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    tools = ("valgrind", "callgrind_control", "strace")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}: apt-get install valgrind strace")
    workdir = Path(tempfile.mkdtemp(prefix="kvl-counts-"))
    try:
        counts = measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = render(counts, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
