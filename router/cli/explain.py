"""``kvledger runs explain RUN_A RUN_B [--episode E] [--limit N]``: proof by replay."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from router.cli.common import AdminApi, CliError, add_admin_options, cli_errors, print_table

LONG_S = 3600.0
DESCRIPTION = """\
Prove by replay whether cache state caused each divergence that `runs diff` finds.

For the first divergent request of each episode, and for each run, the proxy leases a replica,
resets it, replays everything that replica's generation served before the request (until the
fingerprint equals the request's state_before), runs the request again and compares outputs;
then once more on a replica with block reuse off (the cold computation). "Proven" means each
run's output reproduces under its own cache state. Histories holding requests whose inputs
were not kept (production traffic) cannot be replayed and are reported, not counted.

It takes a verified reset and a replay per chain: progress goes to stderr as it happens, the
verdicts to stdout at the end. --limit N samples the first N divergences.
"""
COLUMNS = ("episode", "cause", "A reproduced", "B reproduced", "cold matches", "verdict")


def register(actions: Any) -> None:
    explain = actions.add_parser(
        "explain",
        help="prove by replay whether cache state caused each divergence of two runs",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument("run_a")
    explain.add_argument("run_b")
    explain.add_argument("--episode", help="only this episode")
    explain.add_argument("--limit", type=int, metavar="N", help="at most N divergences (a sample)")
    add_admin_options(explain)
    explain.set_defaults(run=run_explain)


@cli_errors
def run_explain(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be at least 1", code=2)
    api = AdminApi.from_args(args, os.environ)
    body: dict[str, Any] = {"run_a": args.run_a, "run_b": args.run_b}
    if args.episode is not None:
        body["episode"] = args.episode
    if args.limit is not None:
        body["limit"] = args.limit
    for event in api.stream("POST", "/admin/runs/explain", body, timeout_s=LONG_S):
        kind = event.get("event")
        if kind == "error":
            raise CliError(f"explain stopped: {event['error']['message']}")
        if kind == "result":
            return _print_report(args, event["report"])
        print(f"kvledger: explain: {_progress(event)}", file=sys.stderr, flush=True)
    raise CliError("the proxy ended the answer before the result")


def _progress(event: dict[str, Any]) -> str:
    kind = event.get("event")
    if kind == "start":
        return f"{event['cases']} divergence(s) to explain"
    if kind == "proved":
        outcome = "reproduced" if event["reproduced"] else "NOT reproduced"
        return f"run {event['run']}, request {event['request_id']}: {outcome} under its own state"
    if kind == "cold":
        return f"episode {event['episode']}: the cold computation matches {event['matches']}"
    return str(event.get("reason") or event)


def _print_report(args: argparse.Namespace, report: dict[str, Any]) -> int:
    if args.json:
        import orjson

        sys.stdout.write(orjson.dumps(report).decode() + "\n")
        return 0
    rows = [
        [
            case["episode"],
            case["cause"],
            _side(case["a"]),
            _side(case["b"]),
            case["cold_matches"] or "-",
            "PROVEN" if case["proven"] else "not proven",
        ]
        for case in report["cases"]
    ]
    print_table(COLUMNS, rows)
    print(
        f"{report['proven']} of {report['tried']} divergence(s) tried are proven caused by cache"
        " state (each run's output reproduces under its own state)"
    )
    for case in report["cases"]:
        for name in ("a", "b"):
            if case[name]["note"]:
                print(f"  episode {case['episode']}, run {name.upper()}: {case[name]['note']}")
    return 0


def _side(side: dict[str, Any]) -> str:
    reproduced = side["reproduced"]
    return "-" if reproduced is None else "yes" if reproduced else "NO"
