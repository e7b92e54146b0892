"""Routing policies measured: a simulation at 4 to 64 replicas, and a real run through the proxy.

The simulation (default) plays the same seeded chat workload (bench/routing_sim.py) through
each policy at each replica count, and through a single-cache oracle of the same total
capacity; it prints a table and writes ``routing.md``, ``routing.png`` and ``routing.json``
under ``--out``. About three minutes on one core at the defaults.

    .venv/bin/python -m bench.routing [--replicas 4,8,16,32,64] [--capacity 2048] [--seed 1]
        [--conversations-per-replica 100] [--out docs/results]

``--real`` instead sends chat conversations through ``kvledger serve`` in front of three
stand-in replicas, once per policy (bench/routing_real.py), and adds the cached share of prompt
tokens per policy to the same note:

    .venv/bin/python -m bench.routing --real [--conversations 30] [--out docs/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench.routing_report import POLICIES, TWO_PROXIES, chart, markdown
from bench.routing_sim import Outcome, Shape, make_workload, simulate
from policies import Policy, make_policy

STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def figures(outcome: Outcome) -> dict[str, float]:
    return {
        "reuse": outcome.reuse_rate,
        "max_over_mean": outcome.max_over_mean,
        "in_flight": outcome.mean_in_flight,
    }


def factory(name: str) -> Callable[[], Policy]:
    return lambda: make_policy(name)


def one_size(replicas: int, shape: Shape, capacity: int, seed: int) -> dict[str, Any]:
    """Every policy (and two-proxy runs of the prefix policies) at one replica count."""
    workload = make_workload(replicas, shape, seed)
    oracle = simulate(workload, None, replicas, capacity, seed=seed)
    size: dict[str, Any] = {
        "replicas": replicas,
        "requests": workload.requests,
        "oracle": figures(oracle),
        "policies": {},
        "two_proxies": {},
    }
    for name in POLICIES:
        outcome = simulate(workload, factory(name), replicas, capacity, seed=seed)
        size["policies"][name] = figures(outcome)
    for name in TWO_PROXIES:
        outcome = simulate(workload, factory(name), replicas, capacity, proxies=2, seed=seed)
        size["two_proxies"][name] = figures(outcome)
    return size


def print_size(size: dict[str, Any]) -> None:
    oracle = size["oracle"]["reuse"]
    print(
        f"{size['replicas']:>3} replicas, {size['requests']:,} requests;"
        f" oracle reuse {100 * oracle:.1f}%"
    )
    for name in POLICIES:
        one, two = size["policies"][name], size["two_proxies"].get(name)
        pair = (
            f"   two proxies {100 * two['reuse'] / oracle:5.1f}%  {two['max_over_mean']:.2f}"
            if two
            else ""
        )
        print(
            f"    {name:16} reuse {100 * one['reuse']:5.1f}%  of oracle"
            f" {100 * one['reuse'] / oracle:5.1f}%  max/mean {one['max_over_mean']:.2f}"
            f"  in flight {one['in_flight']:4.1f}{pair}",
            flush=True,
        )


def print_real(real: dict[str, Any]) -> None:
    print(f"{real['conversations']} conversations, {real['requests']} requests per policy")
    for row in real["policies"]:
        counts = ", ".join(f"{rid} {n}" for rid, n in sorted(row["per_replica"].items()))
        print(
            f"    {row['policy']:16} cached {100 * row['cached_share']:5.1f}% of"
            f" {row['prompt_tokens']:,} prompt tokens  per replica: {counts}"
            f"  max/mean {row['max_over_mean']:.2f}  {row['seconds']:.0f} s",
            flush=True,
        )


def run_simulation(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(conversations_per_replica=args.conversations_per_replica)
    sizes = []
    for replicas in args.replicas:
        progress(f"simulating {replicas} replicas")
        sizes.append(one_size(replicas, shape, args.capacity, args.seed))
        print_size(sizes[-1])
    return {
        "command": command_line(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": time.perf_counter() - STARTED,
        "seed": args.seed,
        "capacity": args.capacity,
        "shape": dataclasses.asdict(shape),
        "sizes": sizes,
    }


def command_line() -> str:
    return (".venv/bin/python -m bench.routing " + shlex.join(sys.argv[1:])).strip()


def write(out: Path, part: str, figures_: dict[str, Any]) -> None:
    """Store this part's figures beside the other part's, and rebuild the note from both."""
    store = out / "routing.json"
    results = orjson.loads(store.read_bytes()) if store.exists() else {}
    results[part] = figures_
    out.mkdir(parents=True, exist_ok=True)
    store.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
    if "simulation" in results:
        chart(results["simulation"], out / "routing.png")
    (out / "routing.md").write_text(markdown(results, "routing.png"))
    progress(f"wrote {out / 'routing.md'}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__)
    parser.add_argument("--real", action="store_true", help="the run through the proxy")
    parser.add_argument(
        "--replicas",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[4, 8, 16, 32, 64],
        help="replica counts to simulate (default 4,8,16,32,64)",
    )
    parser.add_argument("--capacity", type=int, default=2048, help="blocks per replica cache")
    parser.add_argument("--conversations-per-replica", type=int, default=100)
    parser.add_argument("--conversations", type=int, default=30, help="--real: conversations")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.real:
        from bench.routing_real import run_real

        real = run_real(args.conversations, args.seed, command_line(), progress)
        print_real(real)
        write(args.out, "real", real)
    else:
        write(args.out, "simulation", run_simulation(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
